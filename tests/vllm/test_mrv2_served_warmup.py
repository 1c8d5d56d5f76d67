"""The served-kernel warm-up on Model Runner V2 (served_warmup.py): which
steps it runs, in what order against the JIT monitor's start, and that
serving starts from the state it would have had without them."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from mrv2_fakes import mrv2_req_states  # noqa: E402
from vllm_av.core.cost_model import CostModel  # noqa: E402
from vllm_av.vllm.config import AVOptions  # noqa: E402
from vllm_av.vllm.mrv2.estimator import AcceptanceEstimator  # noqa: E402
from vllm_av.vllm.mrv2.manager import AVManager  # noqa: E402
from vllm_av.vllm.mrv2.served_warmup import (  # noqa: E402
    MRV2ServedKernelsWarmupPatch,
    drafter_input_warmup_sizes,
    run_prefill_warmup,
)

K = 4
R_MAX = 8
IDS = ["a", "b", "c"]


def _drafter_input_block(longest_query: int) -> int:
    """vLLM 0.32's block size of the drafter's step-0 input kernel
    (standalone_ar/speculator.py, prepare_prefill_inputs)."""
    from vllm.utils.math_utils import next_power_of_2

    return min(512, next_power_of_2(longest_query + 2))


def test_mixed_steps_meet_every_block_size_of_the_drafters_input_kernel():
    sizes = drafter_input_warmup_sizes(max_num_batched_tokens=8192, max_model_len=4096,
                                       vocab_size=151936, num_speculative_steps=7)
    # The mixed step's longest query is its prefill chunk: num_tokens - 1.
    blocks = [_drafter_input_block(n - 1) for n in sizes]
    assert blocks == [8, 16, 32, 64, 128, 256, 512]
    # Negative control: vLLM's own warm-up queries (1, 2, K + 1 and K + 2
    # with K = 7) meet two of the eight sizes a served step can.
    assert {_drafter_input_block(q) for q in (1, 2, 8, 9)} == {4, 16}


def test_mixed_steps_stay_inside_the_batch_the_vocabulary_and_the_model_length():
    assert drafter_input_warmup_sizes(100, 4096, 151936, 7) == [6, 14, 30, 62]
    # vLLM's mixed step prompts ids 0, 1, ...: a 64-token test vocabulary
    # takes prefills of at most 64 tokens (ids past it are out of the
    # embedding's range: an illegal memory access on a GPU).
    assert drafter_input_warmup_sizes(8192, 4096, 64, 3) == [6, 14, 30, 62]
    # The request and the drafter's lookahead inside the model's length.
    assert drafter_input_warmup_sizes(8192, 256, 151936, 3) == [6, 14, 30, 62, 126]
    assert drafter_input_warmup_sizes(8192, 40, 151936, 7) == [6, 14]


def _manager():
    rs = mrv2_req_states(IDS, K, R_MAX)
    m = AVManager(rs, torch.zeros(R_MAX + 1, dtype=torch.int32), num_bonus_tokens=1,
                  max_total_logits=10_000, options=AVOptions(metrics_dir=""))
    m.cost = CostModel.from_samples({1: [1.0], 8: [1.0], 9: [3.0], 64: [30.0]},
                                    {1: [0.5], 8: [0.5]})
    return m


def _serve_a_step(m, est):
    """What a warm-up step with our AV on leaves behind: a budget, a record
    of confidences, the estimator's observation of accepted drafts."""
    per_req = {r: 1 + K for r in IDS}
    m.get_num_tokens(per_req, {r: [0] * K for r in IDS})
    idx = np.arange(len(IDS))
    batch = SimpleNamespace(num_reqs=len(IDS), idx_mapping=torch.from_numpy(idx),
                            idx_mapping_np=idx)
    m.record_confidences(torch.full((len(IDS), K), 0.9), batch)
    m.record_confidences(torch.full((len(IDS), K), 0.9), batch)  # lands the first
    rows = torch.arange(R_MAX)
    est.features[:R_MAX] = 3.0
    est.verifying = True
    est.step(rows, torch.full((R_MAX,), K + 1), torch.zeros(R_MAX, dtype=torch.int64))


class _Worker:
    """The fields of vLLM's V2 Worker the hook reads, with vLLM's method
    (recorded) under the patched name."""

    def __init__(self, runner, *, v2=True, jit_warmup=True):
        self.use_v2_model_runner = v2
        self.model_runner = runner
        self.vllm_config = SimpleNamespace(
            kernel_config=SimpleNamespace(enable_jit_warmup=jit_warmup),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
            model_config=SimpleNamespace(get_vocab_size=lambda: 151936))
        self.model_config = SimpleNamespace(seed=0)
        self.parallel_config = SimpleNamespace(data_parallel_index=0)
        self.calls = []

    def execute_model(self, out):
        self.calls.append(("execute", sorted(out.finished_req_ids)))

    def sample_tokens(self, grammar):
        self.calls.append(("sample",))

    def _orig__maybe_activate_jit_monitor(self):
        self.calls.append(("monitor",))

    _maybe_activate_jit_monitor = MRV2ServedKernelsWarmupPatch._maybe_activate_jit_monitor


BLOCK = 16
LOOKAHEAD = K  # the draft model's: K tokens past the request


def _runner(manager, max_num_reqs=R_MAX, num_blocks=4096):
    """The fields of vLLM's V2 runner the warm-up reads: one full-attention
    KV cache group of 16-token blocks."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8,
                             dtype=torch.float32)
    connector = SimpleNamespace(disabled=[])
    connector.set_disabled = connector.disabled.append
    return SimpleNamespace(
        adaptive_verification=manager, max_model_len=4096, max_num_reqs=max_num_reqs,
        num_speculative_steps=K, is_pooling_model=False,
        vllm_config=SimpleNamespace(num_lookahead_tokens=LOOKAHEAD),
        model_state=SimpleNamespace(),
        kv_cache_config=SimpleNamespace(
            num_blocks=num_blocks, kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)]),
        req_states=SimpleNamespace(req_id_to_index={}),
        kv_connector=connector)


@pytest.fixture
def recorded_warmups(monkeypatch):
    """vLLM's warm-up functions replaced by recorders (no model here)."""
    import vllm.v1.worker.gpu.warmup as warmup

    log = SimpleNamespace(calls=[], on_warmup=None)

    def warmup_kernels(runner, execute, sample):
        from vllm import SamplingParams

        # The requests' sampling parameters, as vLLM's function builds them.
        log.calls.append(("warmup_kernels", runner.adaptive_verification is not None,
                          SamplingParams.for_sampler_warmup()))
        if log.on_warmup is not None:
            log.on_warmup(runner)

    def mixed(runner, execute, sample, num_tokens, *, req_id_prefix, **kw):
        log.calls.append(("mixed", num_tokens, req_id_prefix))
        return True

    monkeypatch.setattr(warmup, "_warmup_kernels", warmup_kernels)
    monkeypatch.setattr(warmup, "run_mixed_prefill_decode_warmup", mixed)
    return log


def test_warms_with_our_av_on_then_clears_what_the_steps_taught(recorded_warmups):
    fresh = AcceptanceEstimator(R_MAX, K, torch.device("cpu"), refit_interval=2)
    est = AcceptanceEstimator(R_MAX, K, torch.device("cpu"), refit_interval=2)  # the live one
    m = _manager()  # claims `est`, built last, as a runner's manager claims its drafter's
    recorded_warmups.on_warmup = lambda runner: _serve_a_step(m, est)
    worker = _Worker(_runner(m))

    worker._maybe_activate_jit_monitor()

    # vLLM's warm-up steps with our manager in place (AV on), with vLLM's
    # sampling parameters and then with plain temperature 1, then one mixed
    # step per block size, all before vLLM's method starts the monitor.
    from vllm import SamplingParams

    (_, av_on, theirs), (_, av_on_again, plain) = recorded_warmups.calls[:2]
    assert av_on and av_on_again
    assert theirs.temperature == 0.9 and theirs.top_k == 50 and theirs.repetition_penalty > 1
    # Nothing the sampler processes: its logits stay in the model's dtype.
    assert plain.temperature == 1.0 and plain.top_p == 1.0 and plain.top_k in (0, -1)
    assert plain.min_p == 0 and plain.repetition_penalty == 1 and not plain.logit_bias
    assert plain.frequency_penalty == 0 and plain.presence_penalty == 0
    assert SamplingParams.for_sampler_warmup().temperature == 0.9  # vLLM's, restored
    mixed = recorded_warmups.calls[2:]
    assert [c[1] for c in mixed] == [6, 14, 30, 62, 126, 254, 510]
    assert len({c[2] for c in mixed}) == 7  # distinct request ids
    assert worker.calls == [("monitor",)]
    # Serving starts from the prior with zero counts, as without the steps.
    assert m.stats.num_steps == 0 and m.stats.drafted == 0
    assert all(s.step == -1 for s in m._slots)
    assert est.totals.tolist() == [0.0, 0.0] and est.core.num_steps == 0
    torch.testing.assert_close(est.coefficients, fresh.coefficients)
    # Scores as a manager just built (with an estimator of its own) scores them.
    own = AcceptanceEstimator(R_MAX, K, torch.device("cpu"), refit_interval=2)
    new = _manager()
    np.testing.assert_allclose(m.stale_survival(IDS), new.stale_survival(IDS))
    np.testing.assert_allclose(m.prior_survival_host(), new.prior_survival_host())
    del est, fresh, own


def test_without_the_clearing_the_warm_up_would_leak_into_serving(recorded_warmups, monkeypatch):
    # Negative control for the test above: the same steps with the clearing
    # disabled leave counts and an estimator that has learnt from dummy drafts.
    m = _manager()
    est = AcceptanceEstimator(R_MAX, K, torch.device("cpu"), refit_interval=2)
    recorded_warmups.on_warmup = lambda runner: _serve_a_step(m, est)
    monkeypatch.setattr(AVManager, "forget_warmup", lambda self: None)
    _Worker(_runner(m))._maybe_activate_jit_monitor()
    assert m.stats.num_steps == 2  # one per run of vLLM's warm-up steps
    assert est.totals.tolist() != [0.0, 0.0]
    del est


@pytest.mark.parametrize("case", ["no_av", "vllms_av", "no_jit_warmup", "v1", "no_costs",
                                  "option_off"])
def test_other_workers_get_vllms_method_alone(recorded_warmups, case):
    m = _manager()
    manager = {"no_av": None, "vllms_av": SimpleNamespace(cost=m.cost)}.get(case, m)
    if case == "no_costs":
        m.cost = None
    if case == "option_off":
        m.options = AVOptions(metrics_dir="", served_kernel_warmup=False)
    worker = _Worker(_runner(manager), v2=case != "v1", jit_warmup=case != "no_jit_warmup")
    worker._maybe_activate_jit_monitor()
    assert recorded_warmups.calls == []
    assert worker.calls == [("monitor",)]


def test_a_failed_warm_up_is_logged_cleaned_up_and_serving_still_starts(
        recorded_warmups, caplog):
    m = _manager()
    runner = _runner(m)

    def fail(runner_):
        runner_.req_states.req_id_to_index.update({"_warmup_0_": 0, "_warmup_1_": 1, "real": 2})
        raise RuntimeError("workspace is locked")

    recorded_warmups.on_warmup = fail
    m.stats.num_steps = 5
    worker = _Worker(runner)
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_av"):
        worker._maybe_activate_jit_monitor()
    assert "workspace is locked" in caplog.text
    # The dummy requests are finished; nothing else is touched.
    assert worker.calls == [("execute", ["_warmup_0_", "_warmup_1_"]), ("monitor",)]
    assert m.stats.num_steps == 0


class _StepLog:
    """execute_model / sample_tokens of a worker, recording the steps."""

    def __init__(self):
        self.steps = []

    def execute(self, out):
        self.steps.append(out)

    def sample(self, grammar):
        self.steps.append("sample")


def test_one_request_slot_warms_each_block_size_with_a_prompt(recorded_warmups, caplog):
    """vLLM's mixed step needs two request slots: with one (max_num_seqs 1)
    each size gets one request's prompt of the mixed step's longest query
    instead, scheduled as the scheduler would (blocks for the prompt and
    the drafter's lookahead, drafted at full depth), sampled, finished."""
    m = _manager()
    runner = _runner(m, max_num_reqs=1)
    worker = _Worker(runner)
    log = _StepLog()
    worker.execute_model, worker.sample_tokens = log.execute, log.sample
    with caplog.at_level(logging.INFO, logger="vllm.vllm_av"):
        worker._maybe_activate_jit_monitor()
    assert [c[0] for c in recorded_warmups.calls] == ["warmup_kernels"] * 2  # no mixed step
    sizes = [6, 14, 30, 62, 126, 254, 510]
    assert len(log.steps) == 3 * len(sizes)
    for i, n in enumerate(sizes):
        step, sample, finish = log.steps[3 * i: 3 * i + 3]
        (req,) = step.scheduled_new_reqs
        assert req.req_id == f"_vllm_av_warm{n}" and sample == "sample"
        # The mixed step's longest query: its prefill chunk of n - 1 tokens.
        assert req.prompt_token_ids == list(range(n - 1)) == req.prefill_token_ids
        assert step.num_scheduled_tokens == {req.req_id: n - 1}
        assert step.total_num_scheduled_tokens == n - 1
        assert step.num_spec_tokens_to_schedule == K and req.num_computed_tokens == 0
        blocks = -(-(n - 1 + LOOKAHEAD) // BLOCK)
        assert req.block_ids == (list(range(1, 1 + blocks)),)  # block 0 is the null block
        assert finish.finished_req_ids == {req.req_id} and not finish.scheduled_new_reqs
    assert runner.kv_connector.disabled == [True, False] * len(sizes)
    assert "drafter inputs of 6, 14, 30, 62, 126, 254, 510 tokens, one request's prompt" \
        in caplog.text
    assert m.stats.num_steps == 0  # cleared after, as with the mixed steps


def test_two_request_slots_keep_vllms_mixed_steps(recorded_warmups):
    # Negative control for the test above: with two slots, no prompt steps.
    worker = _Worker(_runner(_manager(), max_num_reqs=2))
    log = _StepLog()
    worker.execute_model, worker.sample_tokens = log.execute, log.sample
    worker._maybe_activate_jit_monitor()
    assert [c[1] for c in recorded_warmups.calls if c[0] == "mixed"] == [
        6, 14, 30, 62, 126, 254, 510]
    assert log.steps == []


def test_a_prompt_the_kv_cache_cannot_hold_is_skipped():
    runner = _runner(_manager(), max_num_reqs=1, num_blocks=2)
    log = _StepLog()
    # 13 prompt tokens and 4 of lookahead take 2 blocks, beside the null
    # block 3 (as vLLM's mixed step counts); 5 and 4 take 1.
    assert not run_prefill_warmup(runner, log.execute, log.sample, 14, "x")
    assert run_prefill_warmup(runner, log.execute, log.sample, 6, "y")
    assert len(log.steps) == 3
    assert not run_prefill_warmup(runner, log.execute, log.sample, 2, "z")  # 1 token: none
