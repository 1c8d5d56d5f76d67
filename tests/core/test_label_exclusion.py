"""Labels are never taken from requests whose target distribution was changed
by sampling transforms the drafter did not see (penalties, bad words,
allowed token ids, grammars); their accepted tokens are still counted.

(a) `AdaptiveVerifier.observe(..., learn=mask)`: the estimator's statistics
    equal those of a run that never observed the excluded rows.
(b) The vLLM adapter's `_learnable` on stand-in objects with the attribute
    names of vLLM 0.32's InputBatch and request state
    (tests/vllm/test_label_exclusion_adapter.py checks the real ones, end
    to end). Importing the adapter module does not import vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from vllm_av.core.cost_model import CostModel
from vllm_av.core.estimator import OnlineAcceptanceEstimator
from vllm_av.core.verifier import AdaptiveVerifier

K = 5
R = 8
IDS = [f"r{i}" for i in range(R)]
EXCLUDED = {"r1", "r4", "r6"}
STEPS = 6


def _verifier(refit_interval: int) -> AdaptiveVerifier:
    # Verification is free: every draft is admitted, so the runs below
    # verify the same drafts whatever they observe.
    cost = CostModel.from_samples({1: [1.0], 4096: [1.0]}, {1: [1.0]}, graph_sizes=[])
    return AdaptiveVerifier(K, cost, OnlineAcceptanceEstimator(K, refit_interval=refit_interval))


def _drive(v: AdaptiveVerifier, mode: str, seed: int = 0) -> int:
    """STEPS steps of R requests with random features and outcomes.

    mode: "mask" observes every row with learn=False for EXCLUDED;
    "drop" observes only the other rows; "all" learns from every row.
    Returns the accepted drafts of the EXCLUDED rows.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    excluded_accepted = 0
    for _ in range(STEPS):
        features = torch.randn(R, K, generator=gen) * 2.0
        drafted = rng.integers(1, K + 1, size=R)
        admitted = v.admit(IDS, features, drafted, num_sampling=R, num_other_tokens=R)
        assert (admitted == drafted).all()
        accepted = rng.integers(0, admitted + 1)
        v.begin_step()
        keep = np.array([rid not in EXCLUDED for rid in IDS])
        excluded_accepted += int(accepted[~keep].sum())
        if mode == "mask":
            v.observe(IDS, admitted, accepted, learn=keep)
        elif mode == "drop":
            ids = [rid for rid in IDS if rid not in EXCLUDED]
            v.observe(ids, admitted[keep], accepted[keep])
        else:
            v.observe(IDS, admitted, accepted)
    return excluded_accepted


def _same_statistics(a: AdaptiveVerifier, b: AdaptiveVerifier) -> bool:
    sa, sb = a.estimator.statistics(), b.estimator.statistics()
    return all(torch.equal(sa[k], sb[k]) for k in sa) and torch.equal(
        a.estimator.coefficients, b.estimator.coefficients
    )


def test_excluded_rows_leave_the_window_statistics_untouched():
    # No refit during the run: the window statistics hold every label.
    masked, dropped, full = _verifier(1000), _verifier(1000), _verifier(1000)
    excluded_accepted = _drive(masked, "mask")
    _drive(dropped, "drop")
    _drive(full, "all")
    assert masked.estimator.statistics()["count"][0] > 0  # it did learn
    assert _same_statistics(masked, dropped)
    # The excluded rows would have changed them (the comparison has teeth).
    assert not _same_statistics(masked, full)
    # Calibration counters follow the labels the estimator took.
    for name in ("predicted", "observed", "labelled"):
        assert np.array_equal(getattr(masked.stats, name), getattr(dropped.stats, name))
    # Their accepted tokens are counted all the same.
    assert excluded_accepted > 0
    assert masked.stats.accepted == dropped.stats.accepted + excluded_accepted
    assert masked.stats.accepted == full.stats.accepted


def test_excluded_rows_leave_the_fit_untouched():
    # Refits along the way: the coefficients and running state match too.
    masked, dropped = _verifier(2), _verifier(2)
    _drive(masked, "mask", seed=3)
    _drive(dropped, "drop", seed=3)
    assert masked.estimator.num_refits == dropped.estimator.num_refits > 0
    assert _same_statistics(masked, dropped)
    assert masked.estimator.intercepts != OnlineAcceptanceEstimator(K).intercepts


def test_all_rows_excluded_feeds_nothing():
    v = _verifier(1)
    features = torch.full((R, K), 2.0)
    admitted = v.admit(IDS, features, np.full(R, K), num_sampling=R, num_other_tokens=R)
    v.begin_step()
    before = v.estimator.statistics(), v.estimator.coefficients
    v.observe(IDS, admitted, np.full(R, 2), learn=np.zeros(R, dtype=bool))
    after = v.estimator.statistics()
    assert all(torch.equal(before[0][k], after[k]) for k in after)
    assert torch.equal(before[1], v.estimator.coefficients)
    assert v.estimator.num_steps == 0
    assert v.stats.accepted == 2 * R
    assert v.stats.labelled.sum() == 0


# ------------------------------------------------------------- the adapter


def _batch(req_ids, **sets):
    """A stand-in for vLLM 0.32's InputBatch (the attributes _learnable reads)."""
    return SimpleNamespace(
        req_ids=list(req_ids),
        frequency_penalties_reqs=set(sets.get("frequency", ())),
        presence_penalties_reqs=set(sets.get("presence", ())),
        repetition_penalties_reqs=set(sets.get("repetition", ())),
        has_allowed_token_ids=set(sets.get("allowed", ())),
        # Keyed by the request's row in the batch, as in vLLM.
        bad_words_token_ids={i: [[7]] for i in sets.get("bad_words_idx", ())},
    )


def _runner(req_ids, grammar=(), **sets):
    """A stand-in runner: input batch plus per-request state; requests in
    `grammar` have structured-output sampling parameters."""
    requests = {
        rid: SimpleNamespace(sampling_params=SimpleNamespace(
            structured_outputs=SimpleNamespace(regex="a+") if rid in grammar else None))
        for rid in req_ids
    }
    return SimpleNamespace(input_batch=_batch(req_ids, **sets), requests=requests)


def _scheduler_output(req_ids, grammar=()):
    # vLLM 0.32's SchedulerOutput only flags that some request has a grammar.
    return SimpleNamespace(
        has_structured_output_requests=bool(grammar),
        scheduled_spec_decode_tokens={rid: [1, 2] for rid in req_ids},
    )


def test_learnable_is_false_exactly_for_transformed_requests():
    from vllm_av.vllm.mrv1.patches import _learnable

    ids = [f"q{i}" for i in range(9)]
    transformed = {
        "frequency": {"q1"},
        "presence": {"q2"},
        "repetition": {"q3"},
        "allowed": {"q5"},
        "bad_words_idx": {6},  # q6
    }
    grammar = {"q8"}
    runner = _runner(ids, grammar=grammar, **transformed)
    got = _learnable(runner, _scheduler_output(ids, grammar), ids)
    assert got.dtype == bool and got.shape == (9,)
    expected = [rid not in {"q1", "q2", "q3", "q5", "q6", "q8"} for rid in ids]
    assert got.tolist() == expected


def test_learnable_bad_words_follow_the_batch_row():
    from vllm_av.vllm.mrv1.patches import _learnable

    ids = ["a", "b", "c"]
    # Bad words are keyed by row index: after a reorder, the row decides.
    runner = _runner(ids, bad_words_idx={0})
    assert _learnable(runner, _scheduler_output(ids), ids).tolist() == [False, True, True]
    runner = _runner(ids, bad_words_idx={2})
    assert _learnable(runner, _scheduler_output(ids), ids).tolist() == [True, True, False]


def test_learnable_plain_batch_is_all_true():
    from vllm_av.vllm.mrv1.patches import _learnable

    ids = ["a", "b"]
    assert _learnable(_runner(ids), _scheduler_output(ids), ids).tolist() == [True, True]


def test_learnable_excludes_logit_bias_and_minimum_length_requests():
    from vllm_av.vllm.mrv1.patches import _learnable

    ids = ["plain", "bias", "min", "min0"]
    params = {
        "plain": SimpleNamespace(structured_outputs=None, logit_bias=None, min_tokens=0),
        "bias": SimpleNamespace(structured_outputs=None, logit_bias={5: -100.0}, min_tokens=0),
        "min": SimpleNamespace(structured_outputs=None, logit_bias=None, min_tokens=8),
        "min0": SimpleNamespace(structured_outputs=None, logit_bias={}, min_tokens=0),
    }
    runner = SimpleNamespace(
        input_batch=_batch(ids),
        requests={rid: SimpleNamespace(sampling_params=p) for rid, p in params.items()},
    )
    got = _learnable(runner, _scheduler_output(ids), ids).tolist()
    assert got == [True, False, False, True]
