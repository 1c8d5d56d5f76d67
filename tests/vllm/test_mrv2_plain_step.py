"""Steps that verify no draft and draft none end as plain decoding on Model
Runner V2 (vllm_av/vllm/mrv2/plain_step.py): when the runner's speculator
is hidden, and when it is not; and vLLM 0.32's code the patch relies on.
The path end to end: tests/vllm/test_mrv2_on_cpu.py (CPU) and
tests/gpu/test_gpu_lossless.py (H200)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_av.vllm.config import AVOptions  # noqa: E402
from vllm_av.vllm.mrv2.depth import drafter_skipped, note_propose  # noqa: E402
from vllm_av.vllm.mrv2.plain_step import MRV2PlainZeroDepthStepPatch, note_no_drafts  # noqa: E402


# ------------------------------------------------------------ vLLM premises
def test_vllm_sample_tokens_reads_the_speculator_only_behind_a_none_check():
    """With the speculator set to None, vLLM's sample_tokens takes its plain
    path: every line that reads it is guarded, the sampler (not the
    rejection sampler) serves a batch with no draft, and the step's
    scheduled depth is in the state it reads."""
    from vllm.v1.worker.gpu import model_runner

    src = inspect.getsource(model_runner.GPUModelRunner.sample_tokens)
    assert src.count("if self.speculator is not None:") == 1
    assert "self.speculator is not None\n" in src  # the multimodal check
    assert "num_spec_tokens_to_schedule" in src
    sample = inspect.getsource(model_runner.GPUModelRunner.sample)
    assert "input_batch.num_draft_tokens == 0 or self.rejection_sampler is None" in sample
    assert "num_spec_tokens_to_schedule" in model_runner.ExecuteModelState._fields


def test_vllm_sample_tokens_reads_the_step_count_only_for_the_draft_handler():
    """With num_speculative_steps at 0 for the call, vLLM's sample_tokens
    skips only its draft-token handler's call (the speculator's block, the
    other reader, is skipped with the speculator hidden)."""
    from vllm.v1.worker.gpu import model_runner

    src = inspect.getsource(model_runner.GPUModelRunner.sample_tokens)
    assert src.count("self.num_speculative_steps") == 2
    assert "if num_spec_tokens < self.num_speculative_steps:" in src  # in the speculator's block
    guarded = src.split("if self.num_speculative_steps > 0:")[1]
    assert guarded.lstrip().startswith("# Spec-decode")
    assert "self.draft_tokens_handler.set_draft_tokens(" in guarded.split("kv_connector")[0]


def test_note_no_drafts_records_what_vllms_handler_records_for_an_empty_draft():
    """Beside vLLM's own `set_draft_tokens` given a [n, 0] draft (the handler
    built without its CUDA stream, which this path never touches)."""
    import torch
    from vllm.v1.worker.gpu.spec_decode.utils import DraftTokensHandler

    batch = SimpleNamespace(req_ids=["a", "b", "c"], has_structured_output_reqs=False)
    theirs, ours = object.__new__(DraftTokensHandler), object.__new__(DraftTokensHandler)
    for h in (theirs, ours):
        h.req_ids, h.num_draft_tokens, h.draft_tokens_np = ["old"], 5, "stale"
    theirs.set_draft_tokens(batch, torch.zeros(3, 0, dtype=torch.int64))
    note_no_drafts(ours, batch)
    assert vars(ours) == vars(theirs)
    assert (ours.req_ids, ours.num_draft_tokens, ours.draft_tokens_np) == (batch.req_ids, 0, None)
    assert theirs.get_draft_tokens().draft_token_ids == [[], [], []]


# ------------------------------------------------------------ the patch
def _speculator(on=True, keep_kv=False, catch_up=False):
    from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import (
        StandaloneARSpeculator)

    spec = object.__new__(StandaloneARSpeculator)
    spec._vllm_av_depth_options = (on, on and keep_kv, on and not keep_kv and catch_up)
    return spec


class _Runner(MRV2PlainZeroDepthStepPatch):
    """The patch's method over a stand-in for vLLM's runner: the original
    records the speculator it saw."""

    def __init__(self, speculator, verified=0, depth=0, option=True, num_reqs=3,
                 structured=False):
        self.vllm_config = SimpleNamespace(additional_config={
            "vllm_av": AVOptions(plain_zero_draft_steps=option).to_dict()})
        self.speculator = speculator
        self.num_speculative_steps = 4
        self.structured = structured
        self.draft_tokens_handler = SimpleNamespace(req_ids=None, num_draft_tokens=None,
                                                    draft_tokens_np="untouched")
        self.steps_seen = []
        self.sampler = object()
        self.is_last_pp_rank, self.pp_handler, self.pcp_manager = True, None, None
        self.seen = []
        self.fail = False
        self.step(verified, depth, num_reqs)

    def step(self, verified, depth, num_reqs=3):
        self.execute_model_state = SimpleNamespace(
            num_spec_tokens_to_schedule=depth,
            input_batch=SimpleNamespace(num_reqs=num_reqs, num_draft_tokens=verified,
                                        req_ids=[f"r{i}" for i in range(num_reqs)],
                                        has_structured_output_reqs=self.structured))

    def _orig_sample_tokens(self, grammar_output):
        self.seen.append(self.speculator)
        self.steps_seen.append(self.num_speculative_steps)
        if self.fail:
            raise RuntimeError("sampling failed")
        return "output"


def test_a_step_verifying_and_drafting_nothing_runs_without_the_speculator():
    spec = _speculator()
    runner = _Runner(spec)
    note_propose(False)
    assert runner.sample_tokens(None) == "output"
    assert runner.seen == [None] and runner.speculator is spec
    assert drafter_skipped()  # our manager's record has nothing to wait for
    # vLLM's draft-token handler call skipped, its record written here.
    assert runner.steps_seen == [0] and runner.num_speculative_steps == 4
    h = runner.draft_tokens_handler
    assert (h.req_ids, h.num_draft_tokens, h.draft_tokens_np) == (["r0", "r1", "r2"], 0, None)


def test_a_plain_step_with_structured_output_keeps_vllms_draft_handler_call():
    """Its handler copies drafts back for the grammar: vLLM's call stays."""
    spec = _speculator()
    runner = _Runner(spec, structured=True)
    runner.sample_tokens(None)
    assert runner.seen == [None] and runner.steps_seen == [4]
    assert runner.draft_tokens_handler.draft_tokens_np == "untouched"


@pytest.mark.parametrize("verified,depth", [(2, 0), (0, 3), (4, 4)],
                         ids=["verifies_drafts", "drafts", "both"])
def test_steps_that_verify_or_draft_keep_the_speculator(verified, depth):
    spec = _speculator()
    runner = _Runner(spec, verified=verified, depth=depth)
    note_propose(False)
    runner.sample_tokens(None)
    assert runner.seen == [spec] and not drafter_skipped()
    assert runner.steps_seen == [4] and runner.draft_tokens_handler.draft_tokens_np == "untouched"


@pytest.mark.parametrize("kwargs", [{"option": False}, {"num_reqs": 0}],
                         ids=["option_off", "empty_batch"])
def test_option_off_or_an_empty_batch_keeps_the_speculator(kwargs):
    spec = _speculator()
    runner = _Runner(spec, **kwargs)
    runner.sample_tokens(None)
    assert runner.seen == [spec]


@pytest.mark.parametrize("spec_kwargs", [{"on": False}, {"keep_kv": True}, {"catch_up": True}],
                         ids=["depth_off", "depth0_runs_first_forward", "catch_up"])
def test_depth_zero_that_still_drafts_or_records_keeps_the_speculator(spec_kwargs):
    """Without adaptive depth every step drafts; with the drafter's first
    forward at depth 0 (its KV kept whole), or its catch-up ledger fed by
    depth-0 steps, `propose` has work at depth 0."""
    spec = _speculator(**spec_kwargs)
    runner = _Runner(spec)
    runner.sample_tokens(None)
    assert runner.seen == [spec]


def test_other_speculators_pipeline_ranks_and_watermarking_keep_the_speculator():
    ngram = SimpleNamespace(vllm_config=None)
    runner = _Runner(ngram)
    runner.sample_tokens(None)
    assert runner.seen == [ngram]

    from vllm.v1.watermarking.gpu_sampler import GPUWatermarkSampler

    for setup in (lambda r: setattr(r, "pp_handler", object()),
                  lambda r: setattr(r, "is_last_pp_rank", False),
                  lambda r: setattr(r, "sampler", object.__new__(GPUWatermarkSampler))):
        spec = _speculator()
        runner = _Runner(spec)
        setup(runner)
        runner.sample_tokens(None)
        assert runner.seen == [spec]


def test_the_speculator_is_restored_when_sampling_fails_and_decided_once_loaded():
    runner = _Runner(None)
    runner.sample_tokens(None)  # before the drafter is loaded: not decided yet
    spec = _speculator()
    runner.speculator = spec
    runner.fail = True
    with pytest.raises(RuntimeError, match="sampling failed"):
        runner.sample_tokens(None)
    assert runner.speculator is spec and runner.seen == [None, None]
    assert runner.num_speculative_steps == 4
    runner.fail = False
    runner.step(verified=1, depth=0)
    runner.sample_tokens(None)
    assert runner.seen[-1] is spec
