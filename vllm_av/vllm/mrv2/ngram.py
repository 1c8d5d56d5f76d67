"""Our AV for Model Runner V2's ngram drafter.

vLLM 0.32's V2 runner builds an AV manager only when its speculator carries
`enable_adaptive_verification`, and reads the slots' confidences from the
speculator's `draft_token_confidence_probs`; its GPU ngram speculator
(`NgramGPUSpeculator`) has neither, and V2 hands the target's verdict
(`observe_verification`) to draft-model speculators only.
`MRV2NgramAVPatch` gives the ngram speculator all three, so our manager
(budget, selector, cost model) serves ngram on V2 as it serves a draft
model:

  __init__  the flag, a [max_num_reqs, K] confidence buffer and our
            estimator (`vllm_av.vllm.mrv2.estimator.AcceptanceEstimator`);
  propose   first folds the verdict on the previous drafts into the
            estimator (the runner passes it as num_sampled / num_rejected),
            then drafts as vLLM does, then scores every slot; at depth 0
            (adaptive depth, chosen when the step is scheduled) it skips
            the scan and the scoring, so the step runs as plain decoding.

The score is the model-free feature of our V1 path
(`vllm_av.core.features.match_length_feature`): log1p of how many tokens
the matched continuation reaches, `reach` (at most K). vLLM's kernel fills
every slot past the reach, and every slot of a request with no match, with
the request's last token; those slots get the feature of no match (0). The
reach is decoded from the scan kernel's per-request scores (`scratch`,
n * (max_model_len + 1) + pos + 1 for the longest, rightmost match), the
request's length and whether it sampled, as vLLM's finalize kernel decodes
them: a property of the context, never of a drafted token (DESIGN 2.5).
"""

from __future__ import annotations

import logging

import torch

from vllm_av.core.features import match_length_feature
from vllm_av.vllm.config import av_options_of
from vllm_av.vllm.mrv2.depth import note_propose
from vllm_av.vllm.mrv2.estimator import AcceptanceEstimator
from vllm_av.vllm.patching import VllmPatch

logger = logging.getLogger("vllm.vllm_av")


def ngram_reach(
    scratch: torch.Tensor,  # [n, n_blocks] int64: the scan kernel's best score per block
    seq_len: torch.Tensor,  # [n] tokens of each request so far
    num_sampled: torch.Tensor,  # [n] tokens sampled last step (0: still in prefill)
    max_model_len: int,
    K: int,
) -> torch.Tensor:
    """[n] int64: how many of a request's K drafts come from its match."""
    score = scratch.max(dim=1).values  # [n]; 0: no match
    has_match = (score > 0) & (num_sampled > 0)
    s1 = (score - 1).clamp(min=0)
    best_n = torch.div(s1, max_model_len + 1, rounding_mode="floor")
    draft_start = s1 - best_n * (max_model_len + 1) + best_n
    avail = (seq_len.long() - draft_start).clamp(min=0, max=K)
    return torch.where(has_match, avail, torch.zeros_like(avail))


def reach_features(reach: torch.Tensor, K: int) -> torch.Tensor:
    """[n, K] float32: log1p(reach) on the slots the match fills, 0 past it."""
    pos = torch.arange(K, device=reach.device)
    filled = pos.unsqueeze(0) < reach.unsqueeze(1)  # [n, K]
    return torch.where(filled, match_length_feature(reach).unsqueeze(1), 0.0)


class MRV2NgramAVPatch(VllmPatch):
    """Serve `enable_adaptive_verification` for ngram on Model Runner V2.

    Target: vllm.v1.worker.gpu.spec_decode.ngram.speculator.NgramGPUSpeculator
        (__init__, propose)
    Why: vLLM 0.32's V2 builds an AV manager only for a speculator that
        carries `enable_adaptive_verification`, which its GPU ngram
        speculator does not; the flag still reaches V2's rejection sampler,
        so such an engine verified every draft with no AV and failed once a
        step's logits outgrew the sampler's single chunk (ngram K=7 at 243
        requests on the H200).
    How: `__init__` adds the flag, a confidence buffer and our estimator
        when our options are in the config; `propose` feeds the previous
        step's verdict to the estimator, drafts as before, and scores each
        slot by how far the request's match reaches (decoded from the scan
        kernel's scores; 0 for the slots vLLM fills with the last token);
        at depth 0 it returns the draft buffer without the scan.
    Upstream: confidences (or a hook for them) in V2's ngram speculator.
    Remove when: vLLM's V2 ngram speculator supports adaptive verification.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu.spec_decode.ngram.speculator:NgramGPUSpeculator"
    attributes = ("__init__", "propose")
    platforms = ("cuda",)

    def __init__(self, vllm_config, device, req_states):
        type(self)._orig___init__(self, vllm_config, device, req_states)
        spec = vllm_config.speculative_config
        self.enable_adaptive_verification = bool(
            spec.enable_adaptive_verification and av_options_of(vllm_config) is not None
        )
        self.acceptance_estimator = None
        if self.enable_adaptive_verification:
            K = self.num_speculative_steps
            self.draft_token_confidence_probs = torch.ones(
                self.max_num_reqs, K, dtype=torch.float32, device=device
            )
            self.acceptance_estimator = AcceptanceEstimator(self.max_num_reqs, K, device)
            logger.info("vllm-av: ngram on Model Runner V2 scored by match reach (K=%d)", K)

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds, dp_sync_state=None,
                dummy_run=False, skip_attn_for_dummy_run=False, mm_inputs=None,
                is_profile=False, num_speculative_tokens=None):
        est = self.acceptance_estimator
        n = input_batch.num_reqs
        idx = input_batch.idx_mapping[:n]
        if est is not None and not dummy_run:
            # The features the verdict grades are the previous propose's.
            est.step(idx, num_sampled[:n], num_rejected[:n])
        note_propose(False)
        if est is not None and not dummy_run and num_speculative_tokens == 0:
            # Depth 0 (adaptive depth): no scan and nothing to score; the
            # runner masks the buffer with -1 and schedules no drafts, and
            # our manager has nothing to record (no wait on its copy).
            note_propose(True)
            return self.drafts[:n]
        drafts = type(self)._orig_propose(
            self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
            aux_hidden_states, num_sampled, num_rejected, last_sampled,
            next_prefill_tokens, temperature, seeds, dp_sync_state=dp_sync_state,
            dummy_run=dummy_run, skip_attn_for_dummy_run=skip_attn_for_dummy_run,
            mm_inputs=mm_inputs, is_profile=is_profile,
            num_speculative_tokens=num_speculative_tokens,
        )
        if est is not None and not dummy_run:
            reach = ngram_reach(self.scratch[:n], self.req_states.total_len.gpu[idx.long()],
                                num_sampled[:n], self.max_model_len, self.num_speculative_steps)
            est.predict_features(reach_features(reach, self.num_speculative_steps), idx,
                                 self.draft_token_confidence_probs)
        return drafts
