import numpy as np
import pytest

from vllm_av.core.cost_model import CostCurve, CostModel, isotonic

GRAPHS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def _h200_1b():
    # DESIGN 1: 1B model on an H200, ms per step at these token counts.
    verify = {1: [0.86, 0.9, 0.8], 64: [0.98], 256: [1.35], 512: [2.16], 1024: [4.0]}
    draft = {1: [0.2], 64: [0.3], 256: [0.5]}
    return CostModel.from_samples(verify, draft, GRAPHS)


def test_costs_are_medians_of_samples():
    cm = CostModel.from_samples({1: [3.0, 1.0, 2.0, 100.0, 2.5]}, {1: [0.5, 0.4, 0.6]}, [])
    assert cm.verify_cost(1) == 2.5
    assert cm.draft_cost(1) == 0.5


def test_costs_are_forced_monotone_non_decreasing():
    cm = CostModel.from_samples({1: [1.0], 8: [0.7], 16: [1.5], 32: [1.2]}, {1: [1.0]}, [])
    x = np.arange(1, 60)
    c = cm.verify_cost(x)
    assert np.all(np.diff(c) >= 0)
    # Violating neighbours are pooled to their mean (isotonic regression).
    assert cm.verify_cost(1) == cm.verify_cost(8) == pytest.approx(0.85)
    assert cm.verify_cost(16) == cm.verify_cost(32) == pytest.approx(1.35)


def test_one_slow_size_does_not_lift_every_larger_size():
    # One slow median (11.3 ms at 16 tokens) among ~6.6 ms ones.
    sizes = [8, 16] + list(range(24, 449, 8))
    costs = [6.5, 11.3] + [6.6] * (len(sizes) - 2)
    curve = CostCurve(sizes, costs, graph_sizes=sizes)
    assert np.all(np.diff(curve.costs) >= 0)
    assert curve(448) < 6.8  # a running max would say 11.3
    assert curve(8) == pytest.approx(6.5)


def test_isotonic_is_the_identity_on_sorted_input_and_keeps_the_mean():
    y = np.array([1.0, 2.0, 2.0, 5.0])
    np.testing.assert_array_equal(isotonic(y), y)
    z = np.array([3.0, 1.0, 2.0, 0.0, 4.0])
    fit = isotonic(z)
    assert np.all(np.diff(fit) >= 0) and fit.sum() == pytest.approx(z.sum())


def test_staircase_inside_graph_range_pads_to_next_profiled_size():
    cm = _h200_1b()
    # 65..256 tokens run in the 256 graph and cost what 256 costs.
    assert cm.verify_cost(65) == cm.verify_cost(256) == 1.35
    assert cm.verify_cost(2) == 0.98  # next profiled size >= 2 is 64
    assert cm.verify_cost(1) == pytest.approx(0.86)
    assert cm.verify_cost(0) == pytest.approx(0.86)


def test_linear_interpolation_and_extrapolation_above_graph_range():
    cm = _h200_1b()
    assert cm.verify_cost(384) == pytest.approx((1.35 + 2.16) / 2)
    assert cm.verify_cost(768) == pytest.approx((2.16 + 4.0) / 2)
    slope = (4.0 - 2.16) / 512
    assert cm.verify_cost(2048) == pytest.approx(4.0 + slope * 1024)


def test_scalar_and_array_inputs_agree():
    cm = _h200_1b()
    x = np.array([0, 1, 3, 64, 100, 300, 1500, 5000])
    arr = cm.verify_cost(x)
    assert isinstance(arr, np.ndarray)
    np.testing.assert_allclose(arr, [cm.verify_cost(int(v)) for v in x])
    np.testing.assert_allclose(cm.verify_cost_range(3, 9), cm.verify_cost(np.arange(3, 9)))
    np.testing.assert_allclose(cm.verify_cost_range(5000, 5003), cm.verify_cost(np.arange(5000, 5003)))
    assert isinstance(cm.draft_cost(np.int64(7)), float)


def test_single_point_curve_is_constant():
    cm = CostModel.from_samples({16: [2.0]}, {4: [1.0]}, [])
    assert cm.verify_cost(1) == cm.verify_cost(16) == cm.verify_cost(1000) == 2.0
    cm = CostModel.from_samples({16: [2.0]}, {4: [1.0]}, [1, 2, 4, 8, 16])
    assert cm.verify_cost(3) == cm.verify_cost(100) == 2.0


@pytest.mark.parametrize(
    "verify, draft, graphs, match",
    [
        ({}, {1: [1.0]}, [], "no verify samples"),
        ({1: []}, {1: [1.0]}, [], "empty"),
        ({1: [1.0]}, {1: [-0.1]}, [], "negative"),
        ({0: [1.0]}, {1: [1.0]}, [], "positive"),
        ({1: [1.0]}, {1: [1.0]}, [0, 4], "positive"),
        ({1: [float("nan")]}, {1: [1.0]}, [], "non-finite"),
    ],
)
def test_bad_samples_raise_clear_value_errors(verify, draft, graphs, match):
    with pytest.raises(ValueError, match=match):
        CostModel.from_samples(verify, draft, graphs)


def test_json_round_trip_and_summary():
    cm = _h200_1b()
    cm2 = CostModel.from_json(cm.to_json())
    x = np.arange(0, 3000, 7)
    np.testing.assert_allclose(cm2.verify_cost(x), cm.verify_cost(x))
    np.testing.assert_allclose(cm2.draft_cost(x), cm.draft_cost(x))
    line = cm.summary()
    assert "\n" not in line and "verify" in line and "draft" in line


def test_depth_views_are_kept_while_the_costs_stand_and_reprice_after_a_correction():
    """`at_depth` hands back the same view while nothing changed, and its
    drafting cost (looked up once per request count) follows every
    correction and the free-depth-0 switch: a kept value that outlived a
    correction would price drafting at the old cost (the control below
    shows the view would have kept it)."""
    cost = CostModel.from_samples({1: [1.0], 64: [2.0]}, {1: [7.0], 64: [14.0]})
    K = 7
    view = cost.at_depth(3, K)
    assert cost.at_depth(3, K) is view
    before = view.draft_cost(8)
    assert before == pytest.approx(float(cost.draft_cost_at_depth(8, 3, K)))
    assert view.draft_cost(8) == before  # looked up once, kept
    cost.set_draft_scale(3, 2.0)  # drafting at depth 3 measured at twice its profile
    after = cost.at_depth(3, K)
    assert after is not view
    assert after.draft_cost(8) == pytest.approx(2.0 * before)
    assert view.draft_cost(8) == before  # control: the old view kept the old price
    kept = cost.at_depth(3, K)
    assert kept is after
    cost.free_zero_depth = True  # what depth 0 costs changed: new views
    assert cost.at_depth(3, K) is not kept
    # Arrays are priced as they come, never kept.
    np.testing.assert_allclose(cost.at_depth(3, K).draft_cost(np.array([1, 64])),
                               cost.draft_cost_at_depth(np.array([1, 64]), 3, K))
