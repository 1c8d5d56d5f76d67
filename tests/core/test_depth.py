"""Adaptive drafting depth: AdaptiveVerifier.choose_depth and depth-priced costs."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from vllm_av.core.budget import size_budget
from vllm_av.core.cost_model import RESCALE_TOLERANCE, CostModel
from vllm_av.core.verifier import (
    EXPLORE_BACKOFF_MAX,
    EXPLORE_HOPELESS_TIME_SHARE,
    EXPLORE_MAX_TIME_SHARE,
    EXPLORE_MIN_INTERVAL,
    CALIBRATION_MIN_SAMPLES,
    CALIBRATION_WINDOW,
    PLAIN_PROBE_INTERVAL,
    PLAIN_PROBES_MAX,
    AdaptiveVerifier,
)

K = 7
FLAT_VERIFY = {1: [1.0], 4096: [1.0]}  # extra tokens are free


def _verifier(draft_ms: float, verify=FLAT_VERIFY, **kw) -> AdaptiveVerifier:
    return AdaptiveVerifier(K, CostModel.from_samples(verify, {1: [draft_ms]}, **kw))


def _ids(n: int) -> list[str]:
    return [f"r{i}" for i in range(n)]


def _depths(v: AdaptiveVerifier, R: int, steps: int, accept_first: bool = True) -> list[int]:
    """Drive `steps` steps of R requests: choose, draft, admit, observe
    (each admitted draft's first slot accepted, or none)."""
    ids, out = _ids(R), []
    for _ in range(steps):
        d = v.choose_depth(ids, num_sampling=R, num_other_tokens=R)
        out.append(d)
        if d:
            drafted = np.full(R, d)
            admitted = v.admit(ids, torch.full((R, K), 2.0), drafted, R, R)
            v.begin_step()
            v.observe(ids, admitted, np.minimum(admitted, int(accept_first)))
    return out


@pytest.fixture
def no_time_share_bound(monkeypatch):
    """Exploration paced by the step-count rule alone (no time-share bound,
    no backoff)."""
    monkeypatch.setattr("vllm_av.core.verifier.EXPLORE_MAX_TIME_SHARE", float("inf"))
    monkeypatch.setattr("vllm_av.core.verifier.EXPLORE_HOPELESS_TIME_SHARE", float("inf"))
    monkeypatch.setattr("vllm_av.core.verifier.EXPLORE_BACKOFF_MAX", 1)


def _costly_drafter(draft_ms: float = 1e6) -> AdaptiveVerifier:
    """Profiled: 90% of a full drafting step at depth 1 (one forward)."""
    return _verifier(draft_ms, draft_by_depth={1: {1: [0.9 * draft_ms]}, K: {1: [draft_ms]}})


def test_prohibitive_drafting_cost_chooses_depth_zero_between_explorations(no_time_share_bound):
    R = 4
    depths = _depths(_verifier(draft_ms=1e6), R, 3 * EXPLORE_MIN_INTERVAL)
    explore = [i for i, d in enumerate(depths) if d]
    assert all(depths[i] == K for i in explore)
    assert len(explore) == 3  # only the exploration steps draft
    assert depths.count(0) == len(depths) - 3


def test_free_drafting_and_free_extra_tokens_choose_full_depth():
    v = _verifier(draft_ms=0.0)
    assert _depths(v, 4, 20) == [K] * 20
    s = v.stats
    assert s.last_depth == K and s.depth_steps == 20 and s.zero_depth_steps == 0


@pytest.mark.parametrize("R, interval", [(1, 8), (16, 8), (64, 32), (256, 128)])
def test_exploration_drafts_full_depth_every_max_8_or_half_the_batch_steps(
    R, interval, no_time_share_bound
):
    depths = _depths(_verifier(draft_ms=1e6), R, 2 * interval + 1)
    full = [i + 1 for i, d in enumerate(depths) if d == K]  # 1-based step numbers
    assert full == [interval, 2 * interval]


def test_explorations_that_change_nothing_back_off_to_a_bounded_interval(monkeypatch):
    """Drafting never pays: after the first exploration each one doubles
    the next interval (8, 16, 32, ... steps), then it stays at
    EXPLORE_BACKOFF_MAX times the base (32: 256 steps). Without the
    backoff they would come every 8 steps."""
    monkeypatch.setattr("vllm_av.core.verifier.EXPLORE_MAX_TIME_SHARE", float("inf"))
    monkeypatch.setattr("vllm_av.core.verifier.EXPLORE_HOPELESS_TIME_SHARE", float("inf"))
    want = [8, 8, 16, 32, 64, 128, 256, 256, 256]
    depths = _depths(_verifier(draft_ms=1e6), 4, sum(want))
    full = [i + 1 for i, d in enumerate(depths) if d == K]
    gaps = np.diff([0] + full).tolist()
    assert gaps == want
    assert EXPLORE_BACKOFF_MAX == 32


def test_a_policy_that_drafts_again_explores_at_the_base_interval(monkeypatch):
    """Once the policy chooses to draft between two explorations (here:
    drafting becomes free), the interval after the next exploration is the
    base one again."""
    monkeypatch.setattr("vllm_av.core.verifier.EXPLORE_MAX_TIME_SHARE", float("inf"))
    monkeypatch.setattr("vllm_av.core.verifier.EXPLORE_HOPELESS_TIME_SHARE", float("inf"))
    v = _verifier(draft_ms=1e6)
    R, ids = 4, _ids(4)
    depths = [v.choose_depth(ids, R, R) for _ in range(8 + 8 + 16)]  # scale 4 after these
    assert [i + 1 for i, d in enumerate(depths) if d == K] == [8, 16, 32]
    assert v._explore_scale == 4
    # A step where the policy itself drafts (a seeded request's floor would
    # not count), then depth 0 again: the next exploration resets the scale.
    v._best_depth = lambda *a, **k: 1
    v._zero_run = None  # the remembered run assumes the search answers from its inputs
    assert v.choose_depth(ids, R, R) == 1
    del v._best_depth
    rest = [v.choose_depth(ids, R, R) for _ in range(31)]
    assert rest == [0] * 30 + [K]  # the fourth exploration, 32 steps after the third
    assert v._explore_scale == 1
    after = [v.choose_depth(ids, R, R) for _ in range(8)]
    assert after[-1] == K and after.count(K) == 1


def test_a_floor_of_full_depth_is_not_the_policy_drafting(monkeypatch):
    """Steps drafted only because of `min_depth` (a seeded request) do not
    reset the backoff."""
    monkeypatch.setattr("vllm_av.core.verifier.EXPLORE_MAX_TIME_SHARE", float("inf"))
    monkeypatch.setattr("vllm_av.core.verifier.EXPLORE_HOPELESS_TIME_SHARE", float("inf"))
    v = _verifier(draft_ms=1e6)
    ids = _ids(4)
    for _ in range(16):
        v.choose_depth(ids, 4, 4)
    assert v._explore_scale == 2
    for _ in range(16):
        v.choose_depth(ids, 4, 4, min_depth=K)
    assert v._explore_scale == 4


def test_exploration_waits_for_a_step_that_allows_it(no_time_share_bound):
    """A due exploration is deferred while `may_explore` is False (prompt
    tokens in the step) and happens at the first step that allows it."""
    R = 4
    v = _verifier(draft_ms=1e6)
    depths = [v.choose_depth(_ids(R), R, R) for _ in range(EXPLORE_MIN_INTERVAL - 1)]
    depths += [v.choose_depth(_ids(R), R, R, may_explore=False) for _ in range(3)]
    depths.append(v.choose_depth(_ids(R), R, R))
    assert depths == [0] * (EXPLORE_MIN_INTERVAL + 2) + [K]
    # A stream of steps that never allow it explores after twice the interval.
    never = [v.choose_depth(_ids(R), R, R, may_explore=False)
             for _ in range(2 * EXPLORE_MIN_INTERVAL)]
    assert never == [0] * (2 * EXPLORE_MIN_INTERVAL - 1) + [K]


def test_min_depth_is_a_floor():
    v = _verifier(draft_ms=1e6)
    assert v.choose_depth(_ids(4), 4, 4, min_depth=K) == K
    assert v.choose_depth(_ids(4), 4, 4) == 0


def test_depth_never_looks_at_the_current_drafts():
    # choose_depth takes no features: it runs before anything is drafted.
    assert "features" not in inspect.signature(AdaptiveVerifier.choose_depth).parameters
    # Two verifiers with the same history choose the same depth whatever
    # this step's drafts turn out to be; the drafts only reach later steps.
    steep = {1: [1.0], 4: [1.0], 5: [3.0], 64: [200.0]}
    a, b = _verifier(0.5, verify=steep), _verifier(0.5, verify=steep)
    ids = _ids(4)
    for step in range(12):
        da = a.choose_depth(ids, 4, 4)
        db = b.choose_depth(ids, 4, 4)
        assert da == db, step
        if da:
            drafted = np.full(4, da)
            a.admit(ids, torch.full((4, K), 3.0), drafted, 4, 4)
            b.admit(ids, torch.full((4, K), 3.0), drafted, 4, 4)
    # Different drafts now, same depth decided before them.
    d = a.choose_depth(ids, 4, 4)
    assert b.choose_depth(ids, 4, 4) == d


def test_admit_charges_the_depth_of_the_drafts_in_the_budget():
    # Verification grows linearly. Charged the K-deep drafting step (1000 ms)
    # every extra verified token is relatively cheap and all 8 one-deep
    # slots pay; charged what a one-deep step costs (0 ms), none does.
    verify = {1: [1.0], 1024: [1024.0]}
    by_depth = {1: {1: [0.0]}, K: {1: [1000.0]}}
    cm = CostModel.from_samples(verify, {1: [1000.0]}, draft_by_depth=by_depth)
    v = AdaptiveVerifier(K, cm)
    ids = _ids(8)
    scores = v.stale_scores(ids, np.ones(8, dtype=np.int64))
    assert size_budget(scores, 8, 8, 8, cm) == 8  # what a K-deep charge would give
    v.admit(ids, torch.full((8, K), 1.0), np.ones(8, dtype=np.int64), 8, 8)
    assert v.stats.last_budget == size_budget(scores, 8, 8, 8, cm.at_depth(1, K)) == 0


def test_observe_pairs_outcomes_with_the_drafts_being_verified():
    class Recorder:
        def __init__(self):
            self.seen = []

        def predict(self, f):
            return torch.full_like(f, 0.5)

        def prior_survival(self, k):
            return torch.cumprod(torch.full((k,), 0.5), 0)

        def observe(self, features, num_admitted, num_accepted):
            self.seen.append(features.clone())

    est = Recorder()
    v = AdaptiveVerifier(K, CostModel.from_samples(FLAT_VERIFY, {1: [0.0]}), est)
    ids = _ids(2)
    v.admit(ids, torch.full((2, K), 1.0), np.full(2, K), 2, 2)  # step t's drafts
    v.begin_step()  # step t+1 verifies them ...
    v.admit(ids, torch.full((2, K), 9.0), np.full(2, K), 2, 2)  # ... and drafts again first
    v.observe(ids, np.full(2, K), np.full(2, 3))
    assert torch.equal(est.seen[0], torch.full((2, K), 1.0))


def test_undrafted_slots_get_the_running_mean_feature_not_placeholders():
    v = _verifier(draft_ms=0.0)
    ids = _ids(2)
    feats = torch.tensor([[4.0] * K, [4.0] * K])
    v.admit(ids, feats, np.full(2, K), 2, 2)
    v.begin_step()
    # Depth 2 now: slots 2.. hold zeros (no draft); their stale survival must
    # come from the mean feature (4.0) at those positions, not from 0.
    shallow = feats.clone()
    shallow[:, 2:] = 0.0
    v.admit(ids, shallow, np.full(2, 2), 2, 2)
    expected = v.estimator.predict(feats[:1])[0].cumprod(0).numpy()
    np.testing.assert_allclose(v.stale_scores(ids[:1], np.array([K])), expected, rtol=1e-6)


def test_depth_priced_costs_interpolate_between_profiled_depths():
    by_depth = {1: {1: [2.0], 64: [4.0]}, K: {1: [14.0], 64: [28.0]}}
    cm = CostModel.from_samples(FLAT_VERIFY, {1: [14.0], 64: [28.0]}, draft_by_depth=by_depth)
    assert cm.draft_cost_at_depth(1, K, K) == cm.draft_cost(1) == 14.0
    assert cm.draft_cost_at_depth(1, 0, K) == 2.0  # depth 0 still runs the KV-sync forward
    assert cm.draft_cost_at_depth(1, 1, K) == 2.0
    assert cm.draft_cost_at_depth(1, 4, K) == pytest.approx(2.0 + 12.0 * 3 / 6)
    assert cm.draft_cost_at_depth(64, 4, K) == pytest.approx(4.0 + 24.0 * 3 / 6)
    # Without a depth-resolved table: d/K of the K-deep table.
    plain = CostModel.from_samples(FLAT_VERIFY, {1: [14.0]})
    assert plain.draft_cost_at_depth(1, 0, K) == 0.0
    assert plain.draft_cost_at_depth(1, 2, K) == pytest.approx(4.0)


def test_cost_json_round_trips_depths_and_reads_tables_without_them():
    by_depth = {1: {1: [2.0]}, K: {1: [14.0]}}
    cm = CostModel.from_samples(FLAT_VERIFY, {1: [14.0]}, draft_by_depth=by_depth)
    back = CostModel.from_json(cm.to_json())
    assert back.draft_cost_at_depth(1, 3, K) == cm.draft_cost_at_depth(1, 3, K)
    assert "depths 1,7" in back.summary()
    old = '{"verify": {"sizes": [1], "costs": [1.0], "graph_sizes": []}, ' \
          '"draft": {"sizes": [1], "costs": [7.0], "graph_sizes": []}}'
    legacy = CostModel.from_json(old)
    assert legacy.draft_by_depth == {}
    assert legacy.draft_cost_at_depth(1, 1, K) == pytest.approx(1.0)


@pytest.mark.parametrize("draft_ms, share", [
    # A full-depth step costs 6x a plain one: all-accepted drafts would pay
    # (8 tokens per request for 6 ms), these (none accepted) do not.
    (5.0, EXPLORE_MAX_TIME_SHARE),
    # 21x: not even all-accepted drafts could pay.
    (20.0, EXPLORE_HOPELESS_TIME_SHARE),
])
def test_exploration_takes_at_most_its_time_share_when_full_depth_is_dear(draft_ms, share):
    # Depth 0 is free (linear drafting table); exploring every 8 steps would
    # spend 40-90% of the time at full depth.
    v = _verifier(draft_ms=draft_ms)
    R, steps = 4, 5000
    depths = _depths(v, R, steps, accept_first=False)
    time_explore = sum(draft_ms for d in depths if d == K)
    time_total = sum(1.0 + draft_ms * d / K for d in depths)
    assert depths.count(K) >= 1
    assert time_explore / time_total <= share * 1.2


def test_measured_drafting_time_corrects_the_profiled_table():
    v = _costly_drafter(draft_ms=1.0)  # profiled: 0.9 ms at depth 1, 1 ms at K
    for _ in range(50):
        v.observe_draft_time(K, 4, 10.0)  # real full-depth steps cost 10x
    assert v.cost.draft_cost_at_depth(4, K, K) == pytest.approx(10.0, rel=1e-3)
    assert v.cost.draft_cost(4) == pytest.approx(10.0, rel=1e-3)
    # Depths never measured borrow the nearest measured depth's correction.
    assert v.cost.draft_cost_at_depth(4, 1, K) == pytest.approx(9.0, rel=1e-3)
    v.observe_draft_time(1, 4, 0.9)  # depth 1 measured as profiled
    for _ in range(50):
        v.observe_draft_time(1, 4, 0.9)
    assert v.cost.draft_cost_at_depth(4, 1, K) == pytest.approx(0.9, rel=1e-3)
    # Profiled tables themselves are untouched; bad samples are ignored.
    assert v.cost.profiled_draft_cost(4, K, K) == pytest.approx(1.0)
    v.observe_draft_time(K, 4, float("nan"))
    v.observe_draft_time(K, 0, 5.0)
    assert v.cost.draft_cost(4) == pytest.approx(10.0, rel=1e-3)


def test_model_free_drafting_is_priced_from_measured_steps():
    # ngram / suffix: nothing profiled (a zero drafting table), so the
    # measured time of a drafting step is its cost, charged at every depth
    # >= 1 (one lookup proposes all K) and not at depth 0 (skipped).
    v = _verifier(draft_ms=0.0)
    v.cost.free_zero_depth = True
    ids = _ids(8)
    assert v.choose_depth(ids, 8, 8) == K  # drafting looks free
    assert v.cost.draft_cost_at_depth(8, K, K) == 0.0
    for ms in (5.0, 5.0):
        v.observe_draft_time(K, 8, ms)
    assert v.cost.draft_measured == {}  # fewer than CALIBRATION_MIN_SAMPLES
    v.observe_draft_time(3, 8, 5.0)
    assert v.cost.draft_measured == {3: 5.0}  # bucket floor(log2 8)
    for d in (1, 3, K):
        assert v.cost.draft_cost_at_depth(8, d, K) == pytest.approx(5.0)
    assert v.cost.draft_cost(8) == pytest.approx(5.0)
    assert v.cost.draft_cost_at_depth(8, 0, K) == 0.0
    # Other request counts take the nearest measured bucket's cost.
    np.testing.assert_allclose(v.cost.draft_cost_at_depth(np.array([1, 64]), 2, K), [5.0, 5.0])
    # A 5 ms lookup in a 1 ms step does not pay for drafts accepted at the
    # prior's rate: depth 0 (plain decoding) between explorations.
    assert v.choose_depth(ids, 8, 8) == 0
    # One freak interval leaves the median where it was.
    v.observe_draft_time(K, 8, 500.0)
    assert v.cost.draft_measured[3] == pytest.approx(5.0)


def test_profiled_drafters_keep_ratio_corrections_only():
    v = _costly_drafter(draft_ms=1.0)
    for _ in range(5):
        v.observe_draft_time(K, 4, 3.0)
    assert v.cost.draft_measured == {}
    assert v.cost.draft_cost(4) == pytest.approx(3.0, rel=1e-3)


def test_calibration_moves_the_depth_decision():
    # Verification nearly free per token, drafting profiled as cheap: full
    # depth. Measured drafting 100x dearer than profiled: depth 0.
    verify = {1: [1.0], 4096: [1.05]}
    v = _verifier(draft_ms=0.1, verify=verify)
    ids = _ids(8)
    assert v.choose_depth(ids, 8, 8) == K
    for _ in range(30):
        v.observe_draft_time(K, 8, 10.0)
    assert v.choose_depth(ids, 8, 8) == 0


def test_measured_step_time_corrects_the_verification_table():
    verify = {1: [2.0], 64: [2.0], 256: [4.0], 1024: [8.0]}
    v = _verifier(draft_ms=1.0, verify=verify)
    cost = v.cost
    before = cost.verify_cost_range(0, 2048).copy()
    for _ in range(50):
        v.observe_verify_time(300, 2.0 * float(cost.verify.table(301)[300]))  # bucket 8
    assert cost.verify_cost(300) == pytest.approx(2.0 * before[300], rel=1e-3)
    # Every bucket borrows the nearest measured one's scale; the table stays
    # monotone and the scalar and range lookups agree.
    after = cost.verify_cost_range(0, 2048)
    np.testing.assert_allclose(after[1:], np.maximum.accumulate(2.0 * before[1:]), rtol=1e-6)
    assert np.all(np.diff(after) >= 0)
    assert cost.verify_cost(np.array([10, 300, 1500])).tolist() == pytest.approx(
        [after[10], after[300], after[1500]])
    # A second bucket measured as profiled keeps its own scale.
    for _ in range(50):
        v.observe_verify_time(20, float(cost.verify.table(21)[20]))  # bucket 4
    assert cost.verify_cost(20) == pytest.approx(before[20], rel=1e-3)
    assert cost.verify_cost(300) == pytest.approx(2.0 * before[300], rel=1e-3)
    # Bad samples are ignored; the profiled curve itself is untouched.
    v.observe_verify_time(0, 5.0)
    v.observe_verify_time(300, float("inf"))
    assert cost.verify(300) == pytest.approx(before[300])


def test_one_freak_step_time_does_not_reprice_every_size():
    """One step measured 100x its profile (a first-use initialisation, a
    stall) must not become the table: trusted alone, a one-token step at
    100x lifts the whole monotone verification table above every drafting
    cost, and depth 0 is never chosen (or re-measured) again."""
    verify = {1: [2.0], 4096: [2.2]}
    v = _verifier(draft_ms=40.0, verify=verify)  # a dear drafter: depth 0 wins
    ids = _ids(1)
    assert v.choose_depth(ids, 1, 1) == 0
    before = v.cost.verify_cost_range(0, 64).copy()
    v.observe_verify_time(1, 100 * 2.0)
    np.testing.assert_allclose(v.cost.verify_cost_range(0, 64), before)
    assert v.choose_depth(ids, 1, 1) == 0
    # Later measurements as profiled outvote it.
    for _ in range(CALIBRATION_MIN_SAMPLES):
        v.observe_verify_time(1, 2.0)
    assert v.cost.verify_cost(1) == pytest.approx(2.0)
    # A level that holds is adopted once it has CALIBRATION_MIN_SAMPLES.
    for i in range(CALIBRATION_WINDOW):
        v.observe_verify_time(300, 3.0 * float(v.cost.verify.table(301)[300]))
        assert (8 in v.cost.verify_scale) == (i + 1 >= CALIBRATION_MIN_SAMPLES)
    assert v.cost.verify_scale[8] == pytest.approx(3.0)


def test_timing_jitter_keeps_the_remembered_depth_zero_choice():
    """Plain steps timed with a few percent of jitter around one level (as
    an async engine times every 4th step) leave the applied correction, and
    with it the cost version that the remembered depth-0 choice is keyed
    on, as it is: the choice is not searched again. A level that moves by
    more than RESCALE_TOLERANCE is applied (the control), and drift adds up
    until it is."""
    v = _verifier(draft_ms=40.0, verify={1: [2.0], 4096: [2.2]})  # depth 0 wins
    ids = _ids(1)
    rng = np.random.default_rng(0)
    jitter = rng.uniform(-0.03, 0.03, size=60)  # +-3%: within the 5% tolerance
    for e in jitter[:CALIBRATION_MIN_SAMPLES]:
        v.observe_verify_time(1, 2.6 * (1 + e), plain=True)
    assert v.choose_depth(ids, 1, 1) == 0
    assert v.choose_depth(ids, 1, 1) == 0  # after a depth-0 step: searched, remembered
    version, applied = v.cost.version, v.cost.plain_verify_scale[0]
    searches = []
    search = v._search_depth
    v._search_depth = lambda *a, **k: searches.append(1) or search(*a, **k)
    for e in jitter[CALIBRATION_MIN_SAMPLES:]:
        v.observe_verify_time(1, 2.6 * (1 + e), plain=True)
        assert v.choose_depth(ids, 1, 1) == 0
    assert v.cost.version == version and v.cost.plain_verify_scale[0] == applied
    assert searches == []  # remembered on every step
    # Control: a level 20% up is applied once its median moves.
    for _ in range(CALIBRATION_WINDOW):
        v.observe_verify_time(1, 2.6 * 1.2, plain=True)
    assert v.cost.version > version
    assert v.cost.plain_verify_scale[0] == pytest.approx(1.3 * 1.2)
    # Drift in steps of 1%, each within the tolerance, is applied once it adds up.
    level, version = 2.6 * 1.2, v.cost.version
    for _ in range(10):
        level *= 1.01
        for _ in range(CALIBRATION_WINDOW):
            v.observe_verify_time(1, level, plain=True)
    assert v.cost.version > version
    assert v.cost.plain_verify_scale[0] == pytest.approx(level / 2.0, rel=RESCALE_TOLERANCE)


def _steps_timed(v: AdaptiveVerifier, spec_ms: float, plain_known: bool) -> None:
    """Plain steps of 8 tokens at 1 ms and speculative steps of 64 at
    `spec_ms` (the profile: 1 ms flat), told apart or not."""
    for _ in range(CALIBRATION_MIN_SAMPLES):
        v.observe_verify_time(8, 1.0, plain=plain_known)
        v.observe_verify_time(64, spec_ms)


def test_a_step_verifying_no_draft_is_priced_as_the_plain_step_it_runs():
    # A free drafter (ngram-like) whose speculative steps cost 10x a plain
    # one: a step that verifies drafts pays for metadata and the rejection
    # sampler that a plain step skips, at any draft count. Even all 7
    # drafts of all 8 requests accepted (8x the tokens) would not pay.
    v = _verifier(draft_ms=0.0)
    v.cost.free_zero_depth = True
    _steps_timed(v, 10.0, plain_known=True)
    assert v.cost.plain_verify_cost(8) == pytest.approx(1.0)
    assert v.cost.verify_cost(8) == pytest.approx(10.0)  # the speculative table
    assert v.cost.verify_scale == {6: pytest.approx(10.0)}
    assert v.cost.plain_verify_scale == {3: pytest.approx(1.0)}
    assert v.choose_depth(_ids(8), 8, 8) == 0
    # The budget prices B = 0 as plain: at 1.5x, drafts must be likely.
    w = _verifier(draft_ms=0.0)
    _steps_timed(w, 1.5, plain_known=True)
    assert size_budget(np.full(8, 0.4), 8, 8, 8, w.cost) == 0  # (8 + 3.2) / 1.5 < 8 / 1
    assert size_budget(np.full(8, 0.99), 8, 8, 8, w.cost) == 8


def test_without_the_split_a_plain_bucket_makes_verification_look_free():
    # Negative control: the same times in one table (plain steps not told
    # apart) price speculative steps of 8..23 tokens from the plain steps'
    # bucket, so shallow drafting looks nearly free and is chosen.
    v = _verifier(draft_ms=0.0)
    v.cost.free_zero_depth = True
    _steps_timed(v, 10.0, plain_known=False)
    assert v.cost.plain_verify_scale == {}
    assert v.choose_depth(_ids(8), 8, 8) > 0


def test_depth_zero_is_probed_until_a_plain_step_is_timed():
    # Free drafting always pays, so depth 0 (a plain step) would never run
    # and B = 0 would stay priced from speculative steps: with probes on,
    # depth 0 every PLAIN_PROBE_INTERVAL steps, at most PLAIN_PROBES_MAX.
    v = _verifier(draft_ms=0.0)
    v.probe_plain_steps = True
    depths = _depths(v, 4, PLAIN_PROBE_INTERVAL * (PLAIN_PROBES_MAX + 4))
    zeros = [i for i, d in enumerate(depths) if d == 0]
    assert len(zeros) == PLAIN_PROBES_MAX
    # (a step due for exploration delays a probe by one)
    assert all(PLAIN_PROBE_INTERVAL <= b - a <= PLAIN_PROBE_INTERVAL + 1
               for a, b in zip(zeros, zeros[1:]))
    # They stop once the plain table has a measurement.
    w = _verifier(draft_ms=0.0)
    w.probe_plain_steps = True
    first = _depths(w, 4, PLAIN_PROBE_INTERVAL + 1)
    assert first.count(0) == 1
    for _ in range(CALIBRATION_MIN_SAMPLES):
        w.observe_verify_time(4, 1.0, plain=True)
    assert 0 not in _depths(w, 4, 4 * PLAIN_PROBE_INTERVAL)


def test_each_verification_table_falls_back_on_the_other():
    v = _verifier(draft_ms=0.0)
    for _ in range(CALIBRATION_MIN_SAMPLES):
        v.observe_verify_time(8, 2.0, plain=True)
    # Only plain steps measured: speculative steps are priced from them.
    assert v.cost.verify_cost(8) == pytest.approx(2.0)
    w = _verifier(draft_ms=0.0)
    for _ in range(CALIBRATION_MIN_SAMPLES):
        w.observe_verify_time(8, 2.0)
    assert w.cost.plain_verify_cost(8) == pytest.approx(2.0)


def test_budget_sizing_reads_the_corrected_table():
    # Profiled: extra tokens free; measured: each step costs 10x at large
    # token counts. The budget shrinks once the measurements are in.
    verify = {1: [1.0], 4096: [1.0]}
    v = _verifier(draft_ms=0.0, verify=verify)
    ids = _ids(64)
    feats = torch.full((64, K), 0.0)
    drafted = np.full(64, K)
    full = v.admit(ids, feats, drafted, 64, 64).sum()
    for _ in range(50):
        v.observe_verify_time(512, 10.0)  # buckets >= 9 measured dear
        v.observe_verify_time(64, 1.0)    # bucket 6 as profiled
    trimmed = v.admit(ids, feats, drafted, 64, 64).sum()
    assert full == 64 * K and trimmed < full


def _best_depth_by_search(v: AdaptiveVerifier, rows, num_sampling, num_other_tokens,
                          margin: float = 0.0) -> int:
    """Reference: the budget search at every depth, shallowest on ties;
    depth 0 unless the best depth beats its rate by 1 + `margin`."""
    from vllm_av.core.budget import best_budget

    R = rows.shape[0]
    rates = [best_budget(rows[:, :d].ravel(), num_sampling, num_other_tokens, R,
                         v.cost.at_depth(d, K))[1] for d in range(K + 1)]
    d = int(np.argmax(rates))
    return d if d == 0 or rates[d] >= rates[0] * (1 + margin) else 0


def test_the_one_sort_depth_search_decides_as_a_budget_search_per_depth(monkeypatch):
    """`best_depth` (every depth from one sort) must choose what a budget
    search at every depth chooses, with the same rate, shallowest on ties:
    on random survival rows and tables, from drafting that always pays to
    drafting that never does, with plain steps priced apart, ties from
    zero and equal rows, and non-finite scores. Negative control: the same
    search over the slots in row order instead of best first (the one sort
    left out) takes worse slots first and is caught."""
    import vllm_av.core.budget as budget_mod

    rng = np.random.default_rng(0)
    verify = {1: [1.0], 64: [1.5], 512: [4.0], 4096: [20.0]}
    decisions, caught = [], 0
    real_argsort = np.argsort

    def unsorted(a, *args, **kwargs):  # the negative control: row order
        return np.arange(np.size(a))

    for draft_ms in (0.3, 1.0, 2.0, 3.0, 30.0):
        v = _verifier(draft_ms, verify=verify,
                      draft_by_depth={1: {1: [0.3 * draft_ms], 64: [0.5 * draft_ms]},
                                      K: {1: [draft_ms], 64: [2 * draft_ms]}})
        v.cost.free_zero_depth = True  # as served when depth 0 skips the drafter
        if draft_ms == 2.0:
            v.cost.set_verify_scale(0, 0.5, plain=True)  # plain steps priced apart
        for case in range(40):
            R = int(rng.integers(1, 80))
            acc = rng.uniform(0.01, 0.95, size=(R, 1))
            rows = np.cumprod(np.broadcast_to(acc, (R, K)), axis=1).astype(
                np.float32 if case % 2 else np.float64)
            if case % 7 == 0:
                rows = np.zeros_like(rows)  # every depth ties at B = 0
            if case % 11 == 0:
                rows[0, 0] = np.nan
            want = _best_depth_by_search(v, rows, R, R)
            decisions.append(want)
            draft = [float(v.cost.at_depth(d, K).draft_cost(R)) for d in range(K + 1)]
            d, rate = budget_mod.best_depth(rows, R, R, draft, v.cost)
            assert d == want
            # The verifier's search holds depth 0 within its entry margin.
            assert v._search_depth(rows, R, R) == _best_depth_by_search(
                v, rows, R, R, margin=v.depth_entry_margin)
            ref = budget_mod.best_budget(rows[:, :d].ravel(), R, R, R, v.cost.at_depth(d, K))[1]
            assert rate == ref
            monkeypatch.setattr(budget_mod.np, "argsort", unsorted)
            try:
                caught += budget_mod.best_depth(rows, R, R, draft, v.cost)[0] != want
            finally:
                monkeypatch.setattr(budget_mod.np, "argsort", real_argsort)
    assert 0 in decisions and max(decisions) > 0  # both regimes covered
    assert caught > 0  # the check can fail


def _count_calls(monkeypatch, method: str) -> list:
    """Calls of AdaptiveVerifier.<method> from now on, one entry each."""
    calls = []
    original = getattr(AdaptiveVerifier, method)

    def counted(self, *args):
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(AdaptiveVerifier, method, counted)
    return calls


def test_a_depth_zero_choice_is_reused_only_while_nothing_it_reads_changes(monkeypatch):
    """After a depth-0 step every row is the estimator's prior, so the
    choice is remembered while the batch's counts, the prior and the costs
    stay as they were: the search runs once for a run of such steps, and a
    cost correction that makes drafting pay shows at the next step, as a
    fresh search gives it. Negative control: a remembered choice keyed
    without the costs' version keeps depth 0 after the correction."""
    search = AdaptiveVerifier._search_depth
    searches = _count_calls(monkeypatch, "_search_depth")
    # No exploration step (depth K whatever the search says) in the way.
    monkeypatch.setattr("vllm_av.core.verifier.EXPLORE_MIN_INTERVAL", 10**9)

    def run(keep_version: bool) -> tuple[list[int], int]:
        v = _costly_drafter()
        v.cost.free_zero_depth = True
        ids = _ids(16)
        depths = [v.choose_depth(ids, 16, 16) for _ in range(20)]
        assert depths == [0] * 20
        n = len(searches)
        for d in range(1, K + 1):
            version = v.cost.version
            v.cost.set_draft_scale(d, 1e-9)  # drafting now costs next to nothing
            if keep_version:
                v.cost.version = version
        after = v.choose_depth(ids, 16, 16)
        fresh = search(v, np.broadcast_to(v._prior_host(), (16, K)), 16, 16)
        return [after, fresh], n

    searches.clear()
    (after, fresh), n = run(keep_version=False)
    # Twenty depth-0 steps, two searches: the first step's (no depth chosen
    # before it) and the first in the depth-0 regime; none after.
    assert n == 2
    assert after == fresh > 0
    searches.clear()
    (stale, fresh), _ = run(keep_version=True)
    assert stale == 0 and fresh > 0


def test_the_exploration_interval_is_recomputed_only_when_what_it_reads_changes(monkeypatch):
    """Past the step-count floor the exploration interval is asked every
    step; it is computed again only when the batch's counts, the last depth
    or the costs change, and a cost correction shows at the next ask as a
    fresh computation gives it. Negative control: an interval keyed without
    the costs' version stays as it was after the correction."""
    compute = AdaptiveVerifier._compute_explore_interval
    computed = _count_calls(monkeypatch, "_compute_explore_interval")

    def run(keep_version: bool):
        v = _costly_drafter(draft_ms=5.0)  # dear enough for depth 0, explored now and then
        v.cost.free_zero_depth = True
        ids = _ids(16)
        depths = [v.choose_depth(ids, 16, 16) for _ in range(400)]
        explorations = sum(d == K for d in depths)
        v._last_depth = 0  # as after a depth-0 step
        v._explore_interval(16, 16)
        version = v.cost.version
        v.cost.set_draft_scale(K, 50.0)  # full depth now far dearer: explore less often
        if keep_version:
            v.cost.version = version
        asked = v._explore_interval(16, 16)
        fresh = compute(v, 16, 16, v._last_depth)
        return depths, explorations, asked, fresh

    computed.clear()
    depths, explorations, asked, fresh = run(keep_version=False)
    steps_past_floor = sum(1 for _ in depths) - EXPLORE_MIN_INTERVAL
    print(f"{len(computed)} computations over {len(depths)} steps, {explorations} explorations")
    assert explorations >= 1 and depths.count(0) > len(depths) / 2
    # The last depth alternates 0 / K around each exploration step.
    assert len(computed) <= 2 * explorations + 3 < steps_past_floor / 4
    assert asked == fresh
    _, _, stale, fresh = run(keep_version=True)
    assert stale != fresh


def test_served_step_periods_price_what_a_step_costs_beyond_its_forwards():
    """observe_step_period: a plain step's whole period corrects the plain
    table; a drafting step's period less its priced drafting corrects the
    table of steps that verify drafts. Here the engine adds 0.6 ms of host
    work to every step: profiled, plain decoding (2.0 ms a token) beats
    depth 1 (1.7 tokens for 2.0 + 1.6 ms); served, depth 1 wins (2.6 ms a
    token against 1.7 for 4.2 ms)."""
    v = _verifier(draft_ms=7 * 1.6, verify={1: [2.0], 64: [2.0]})
    v.cost.free_zero_depth = True
    rows = np.array([[0.7 ** (i + 1) for i in range(K)]])
    assert v._search_depth(rows, 1, 1) == 0
    for _ in range(CALIBRATION_MIN_SAMPLES):
        v.observe_step_period(0, 1, 2.0 + 0.6)
        v.observe_step_period(1, 1, 2.0 + 0.6 + 1.6)
    assert v.cost.verify_cost(1, plain=True) == pytest.approx(2.6)
    assert v.cost.verify_cost(2) == pytest.approx(2.6)
    assert v._search_depth(rows, 1, 1) == 1
    # A period shorter than its priced drafting says nothing (no negative time).
    before = v.cost.verify_cost(2)
    v.observe_step_period(K, 1, 0.5)
    assert v.cost.verify_cost(2) == before


def test_exploration_time_share_counts_the_verification_of_its_drafts():
    # Drafting is cheap (0.5 ms for all K) but verifying R * K more tokens
    # costs 9 ms more than a plain 1 ms step: the full-depth step's extra
    # time is mostly verification, which the share must count.
    R, steps = 4, 3000
    verify = {1: [1.0], R: [1.0], R * (K + 1): [10.0]}
    v = _verifier(draft_ms=0.5, verify=verify)
    depths = _depths(v, R, steps, accept_first=False)

    def step_ms(d):
        c = v.cost
        own = float(c.plain_verify_cost(R)) if d == 0 else float(c.verify_cost(R + R * d))
        return own + float(c.draft_cost_at_depth(R, d, K))

    total = sum(step_ms(d) for d in depths)
    explore = sum(step_ms(K) - step_ms(0) for d in depths if d == K)
    assert depths.count(K) >= 1
    assert explore / total <= EXPLORE_MAX_TIME_SHARE * 1.2, (explore / total, depths.count(K))


def test_drafting_must_beat_plain_decoding_by_the_entry_margin():
    """One request, plain steps 2.0 ms, drafting 1.6 ms a position. With
    first-position acceptance 0.83, depth 1 yields 1.83 tokens in 3.6 ms:
    1.7% above plain decoding's 0.5 a ms, inside the 3% margin, so depth 0;
    at 0.9 (5.6% above) the policy drafts. Without the margin (the negative
    control) it drafts in both, as the plain argmax would."""
    from vllm_av.core.budget import best_depth
    from vllm_av.core.verifier import DEPTH_ENTRY_MARGIN

    assert DEPTH_ENTRY_MARGIN == pytest.approx(0.03)
    v = _verifier(draft_ms=7 * 1.6, verify={1: [2.0], 64: [2.0]})
    v.cost.free_zero_depth = True
    draft = [float(v.cost.at_depth(d, K).draft_cost(1)) for d in range(K + 1)]
    for a, with_margin in ((0.83, 0), (0.9, 1)):
        rows = np.array([[a ** (i + 1) for i in range(K)]])
        d_plain, rate = best_depth(rows, 1, 1, draft, v.cost)
        assert d_plain >= 1 and rate > 0.5  # drafting beats plain decoding at all
        assert (v._search_depth(rows, 1, 1) > 0) == bool(with_margin)
        v.depth_entry_margin = 0.0
        assert v._search_depth(rows, 1, 1) == d_plain
        v.depth_entry_margin = DEPTH_ENTRY_MARGIN


def _zero_run_scenario(v: AdaptiveVerifier, seed: int, steps: int = 3000) -> list[int]:
    """Depths of `steps` steps where the batch, the costs and the prior keep
    changing: the request count moves among three sizes, prompts now and
    then defer exploration, a seeded request floors the depth at K, cost
    corrections make drafting cheap or dear, and drafting steps observe
    random outcomes (which move the prior). Seeded: the same seed drives
    two verifiers through the same events."""
    rng = np.random.default_rng(seed)
    v.cost.free_zero_depth = True  # depth 0 skips the drafter, as served on V2
    R = 16
    out = []
    for _ in range(steps):
        u = rng.random()
        if u < 0.01:
            R = int(rng.choice([4, 16, 40]))
        elif u < 0.02:
            depth, factor = int(rng.integers(1, K + 1)), float(rng.choice([1e-3, 1.0, 30.0, 30.0]))
            v.cost.set_draft_scale(depth, factor)
        elif u < 0.025:
            v.depth_entry_margin = float(rng.choice([0.0, 0.03]))
        ids = _ids(R)
        may_explore = bool(rng.random() > 0.05)
        min_depth = K if rng.random() < 0.01 else 0
        d = v.choose_depth(ids, R, R, min_depth=min_depth, may_explore=may_explore)
        out.append(d)
        if d:
            admitted = v.admit(ids, torch.full((R, K), float(rng.normal(1.0, 1.0))),
                               np.full(R, d), R, R)
            v.begin_step()
            v.observe(ids, admitted, np.minimum(admitted, rng.integers(0, 3, size=R)))
    return out


def _reference_choice(v: AdaptiveVerifier) -> AdaptiveVerifier:
    """`v` with no remembered depth-0 run: every step takes the full path."""
    full = v.choose_depth

    def choose(*args, **kwargs):
        v._zero_run = None
        return full(*args, **kwargs)

    v.choose_depth = choose
    return v


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_remembered_depth_zero_run_answers_as_the_full_path(monkeypatch, seed):
    """A run of depth-0 steps answers 0 without the search while its key,
    the prior and the exploration counter allow (`_keep_zero_run`): over
    steps where the batch, the floor, exploration, the costs and the prior
    change, every depth equals the full path's, step by step, and the search
    runs on far fewer steps. Deterministic (seeded events, no sampling)."""
    searches = _count_calls(monkeypatch, "_best_depth")
    fast = _zero_run_scenario(_costly_drafter(draft_ms=5.0), seed)
    fast_searches = len(searches)
    searches.clear()
    full = _zero_run_scenario(_reference_choice(_costly_drafter(draft_ms=5.0)), seed)
    print(f"seed {seed}: depth 0 on {fast.count(0)} of {len(fast)} steps, "
          f"{sum(d not in (0, K) for d in fast)} steps drafted by choice, "
          f"searches {fast_searches} against {len(searches)}")
    assert fast == full
    assert fast.count(0) > 0.1 * len(fast)  # runs of depth 0 ...
    assert any(0 < d < K for d in fast)  # ... and cost corrections that made drafting pay
    # Most depth-0 steps answered from the remembered run.
    assert len(searches) - fast_searches > 0.7 * fast.count(0)


def test_a_zero_run_keyed_without_the_costs_misses_a_correction(monkeypatch):
    """Negative control for the test above: a remembered run whose key
    leaves out the costs' version keeps answering 0 after a correction that
    makes drafting pay, and the depths part from the full path's."""
    original = AdaptiveVerifier._zero_run_key

    def without_version(self, *args):
        key = original(self, *args)
        return key[:6] + key[7:]

    monkeypatch.setattr(AdaptiveVerifier, "_zero_run_key", without_version)
    fast = _zero_run_scenario(_costly_drafter(draft_ms=5.0), 0)
    full = _zero_run_scenario(_reference_choice(_costly_drafter(draft_ms=5.0)), 0)
    assert fast != full
