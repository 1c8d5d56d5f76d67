"""A step that verifies no draft and drafts none ends as plain decoding
(Model Runner V2).

After sampling, vLLM 0.32's V2 runner hands every step with a speculator to
it: it gives the acceptance estimator the step's verdicts, calls `propose`,
masks the drafts past the scheduled depth, writes them into the request
states and gathers them again for the draft-token handler. With our
adaptive depth most steps under load verify nothing (the previous step
drafted nothing) and draft nothing (depth 0, the drafter skipped by
`MRV2DraftDepthPatch`): every one of those calls then has nothing to do, yet
costs host time. On the H200 (twenty-fourth round, one request, cProfile)
`sample_tokens` alone took 0.08-0.1 ms per step more of its own time than
in plain V2, the largest single difference between a depth-0 step of ours
and a plain step.

Such a step runs `sample_tokens` with the runner's speculator hidden, so it
ends as plain V2 decoding does. What is left out, and why nothing reads it:
- the estimator's observation: the step verified no draft, and our
  estimator with adaptive depth learns only from steps whose drafts were
  budgeted (`AcceptanceEstimator.verifying`);
- `propose` at depth 0, which with option zero_depth_skips_drafter (and no
  catch-up) only returns the draft buffer and notes that the drafter was
  skipped; `note_propose(True)` is called here instead;
- the -1 drafts written into the request states: the next step schedules
  no draft (its depth is this one's, chosen when it was scheduled), so its
  inputs read none of them, and the next drafting step writes its own;
- our manager's `record_confidences`, which returns at once after a skipped
  drafter.
The draft-token handler is still told of the step (an empty draft), as
vLLM would tell it, but without the gather of the request states' draft
buffer that vLLM runs first (a [n, 0] device index, which under cProfile
made up most of the 35-40 us per step that `sample_tokens` still took
over plain V2's on the H200, thirtieth round); a batch with structured
output requests keeps vLLM's call (its handler copies drafts back for
grammar checks). Nothing here reads a token (DESIGN 2.5): the decision
uses the step's scheduled counts only.
"""

from __future__ import annotations

from vllm_av.vllm.config import av_options_of
from vllm_av.vllm.mrv2.depth import depth_options, note_propose
from vllm_av.vllm.patching import VllmPatch

# Whether the runner may end such steps as plain decoding (decided once:
# the config and the speculator do not change).
_APPLIES_ATTR = "_vllm_av_plain_zero_depth"


def runner_applies(runner) -> bool:
    """Our option plain_zero_draft_steps on, a draft-model speculator whose
    depth 0 skips the drafter outright (adaptive depth on, option
    zero_depth_skips_drafter on, no catch-up), the last pipeline rank with
    no pipeline or context-parallel handler, and no watermarking sampler
    (whose draft state the speculator prepares each step)."""
    options = av_options_of(runner.vllm_config)
    speculator = getattr(runner, "speculator", None)
    if options is None or not options.plain_zero_draft_steps or speculator is None:
        return False
    from vllm.v1.watermarking.gpu_sampler import GPUWatermarkSampler
    from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import (
        StandaloneARSpeculator)

    if not isinstance(speculator, StandaloneARSpeculator):
        return False
    on, first_forward_at_zero, catch_up = depth_options(speculator)
    if not on or first_forward_at_zero or catch_up:
        return False
    if not getattr(runner, "is_last_pp_rank", True):
        return False
    if getattr(runner, "pp_handler", None) is not None:
        return False
    if getattr(runner, "pcp_manager", None) is not None:
        return False
    return not isinstance(getattr(runner, "sampler", None), GPUWatermarkSampler)


def note_no_drafts(handler, input_batch) -> None:
    """What vLLM 0.32's `DraftTokensHandler.set_draft_tokens` records for a
    batch that drafted nothing and has no structured output request: its
    requests, no draft, nothing to copy back."""
    handler.req_ids = input_batch.req_ids
    handler.num_draft_tokens = 0
    handler.draft_tokens_np = None


def is_plain_step(state) -> bool:
    """Whether the executed step (vLLM's ExecuteModelState) verifies no
    draft and has none to draft."""
    if state is None or state.num_spec_tokens_to_schedule != 0:
        return False
    batch = state.input_batch
    return batch is not None and batch.num_reqs > 0 and batch.num_draft_tokens == 0


class MRV2PlainZeroDepthStepPatch(VllmPatch):
    """End a step that verifies no draft and drafts none as plain V2 decoding.

    Target: vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample_tokens
    Why: vLLM 0.32's V2 runner hands every step to its speculator after
        sampling (estimator observation, `propose`, the drafts masked,
        written into the request states and gathered again), so a step of
        our adaptive depth 0 that follows another pays that host work for
        nothing: on the H200 0.08-0.1 ms per step at one request.
    How: with option plain_zero_draft_steps on and our adaptive depth
        skipping the drafter at depth 0 (no catch-up, a draft-model
        speculator, no pipeline or context parallelism, no watermarking),
        a step whose batch verified no draft and whose scheduled depth is 0
        runs the original with the runner's speculator set to None for the
        call (vLLM's own plain path) and notes the drafter as skipped;
        without structured output requests also with the runner's
        `num_speculative_steps` at 0 for the call, so that vLLM skips its
        draft-token handler's device gather, and the handler is told of
        the empty draft here (`note_no_drafts`). Every other step runs
        unchanged.
    Upstream: skip the speculator's bookkeeping in sample_tokens when a
        step schedules no draft and verified none.
    Remove when: vLLM's V2 runner skips it itself.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
    attributes = ("sample_tokens",)
    platforms = ("cuda",)

    def sample_tokens(self, grammar_output):
        orig = type(self)._orig_sample_tokens
        applies = getattr(self, _APPLIES_ATTR, None)
        if applies is None and self.speculator is not None:  # once it is loaded
            applies = runner_applies(self)
            setattr(self, _APPLIES_ATTR, applies)
        if not applies or not is_plain_step(self.execute_model_state):
            return orig(self, grammar_output)
        batch = self.execute_model_state.input_batch
        own_handler = not batch.has_structured_output_reqs
        speculator, steps = self.speculator, self.num_speculative_steps
        self.speculator = None
        if own_handler:
            self.num_speculative_steps = 0
        note_propose(True)
        try:
            out = orig(self, grammar_output)
        finally:
            self.speculator, self.num_speculative_steps = speculator, steps
        if own_handler:
            note_no_drafts(self.draft_tokens_handler, batch)
        return out
