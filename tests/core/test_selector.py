import pytest
import torch

from vllm_av.core.selector import admitted_layout, compiled_select_admitted, select_admitted


def _brute_force(survival, num_drafted, budget):
    """Global top-B by an explicit key: (survival desc, position asc, request asc)."""
    R, K = survival.shape
    s = torch.cummin(survival, 1).values  # selector's contract for non-monotone rows
    slots = [(r, j) for r in range(R) for j in range(K) if j < int(num_drafted[r])]
    slots.sort(key=lambda rj: (-float(s[rj[0], rj[1]]), rj[1], rj[0]))
    admitted = torch.zeros(R, dtype=torch.int32)
    for r, _ in slots[: max(int(budget), 0)]:
        admitted[r] += 1
    return admitted


def _random_case(g, R, K, levels=5):
    # Quantised confidences make exact survival ties common.
    conf = torch.randint(0, levels + 1, (R, K), generator=g).float() / levels
    survival = torch.cumprod(conf, 1)
    num_drafted = torch.randint(0, K + 1, (R,), generator=g)
    return survival, num_drafted


def test_selector_equals_brute_force_top_b_with_tie_rule():
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        R = int(torch.randint(1, 9, (1,), generator=g))
        K = int(torch.randint(1, 6, (1,), generator=g))
        survival, nd = _random_case(g, R, K, levels=int(torch.randint(1, 4, (1,), generator=g)))
        total = int(nd.sum())
        for budget in (0, 1, total // 2, total, total + 3):
            out = select_admitted(survival, nd, budget)
            torch.testing.assert_close(out, _brute_force(survival, nd, budget))
            assert int(out.sum()) == min(budget, total)
            assert torch.all(out <= nd)


def test_ties_go_to_earlier_position_then_lower_request():
    survival = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]])
    nd = torch.tensor([3, 3])
    assert select_admitted(survival, nd, 1).tolist() == [1, 0]
    assert select_admitted(survival, nd, 3).tolist() == [2, 1]
    assert select_admitted(survival, nd, 4).tolist() == [2, 2]


def test_rows_with_zero_drafts_get_nothing_and_budget_beyond_total_admits_all():
    survival = torch.tensor([[1.0, 1.0], [0.9, 0.8], [1.0, 1.0]])
    nd = torch.tensor([0, 2, 1])
    assert select_admitted(survival, nd, 100).tolist() == [0, 2, 1]
    assert select_admitted(survival, nd, 2).tolist() == [0, 1, 1]


def test_budget_as_zero_dim_tensor_equals_int_budget():
    g = torch.Generator().manual_seed(1)
    survival, nd = _random_case(g, 16, 7)
    for b in (0, 5, 40, 200):
        torch.testing.assert_close(
            select_admitted(survival, nd, torch.tensor(b)), select_admitted(survival, nd, b)
        )


def test_non_monotone_survival_still_admits_a_prefix():
    survival = torch.tensor([[0.2, 0.9, 0.9], [0.5, 0.4, 0.3]])
    nd = torch.tensor([3, 3])
    # Running min makes row 0 [0.2, 0.2, 0.2]: its later slots cannot jump
    # ahead of its first one, so row 1 (0.5, 0.4, 0.3) takes the budget.
    out = select_admitted(survival, nd, 3)
    assert out.tolist() == [0, 3]
    assert select_admitted(survival, nd, 4).tolist() == [1, 3]


def test_admitted_layout_counts_one_extra_token_per_request():
    layout = admitted_layout(torch.tensor([2, 0, 3], dtype=torch.int32))
    assert layout.num_tokens.tolist() == [3, 1, 4]
    assert layout.query_start_loc.tolist() == [0, 3, 4, 8]
    assert layout.cu_num_admitted.tolist() == [2, 2, 5]
    assert layout.query_start_loc.dtype == torch.int32


def test_compiled_selector_equals_eager_on_random_inputs_with_ties():
    g = torch.Generator().manual_seed(2)
    fn = compiled_select_admitted()
    R, K = 32, 7  # one static shape: a single compile
    for trial in range(40):
        survival, nd = _random_case(g, R, K, levels=3)
        budget = int(torch.randint(0, R * K + 5, (1,), generator=g))
        expected = select_admitted(survival, nd, budget)
        torch.testing.assert_close(fn(survival, nd, budget), expected)
        torch.testing.assert_close(fn(survival, nd, torch.tensor(budget)), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_selector_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(3)
    survival, nd = _random_case(g, 64, 7)
    out = select_admitted(survival.cuda(), nd.cuda(), torch.tensor(100, device="cuda"))
    torch.testing.assert_close(out.cpu(), select_admitted(survival, nd, 100))


def test_pairwise_ranking_equals_the_stable_sort_on_ties():
    # The GPU path ranks by pairwise comparison; on the CPU both can run.
    from vllm_av.core.selector import _rank_by_sort, _rank_pairwise

    g = torch.Generator().manual_seed(3)
    for n in (1, 7, 64, 448):
        flat = (torch.rand(n, generator=g) * 4).floor() / 4  # heavy ties
        flat[torch.rand(n, generator=g) < 0.2] = float("-inf")
        assert torch.equal(_rank_pairwise(flat), _rank_by_sort(flat))


@pytest.mark.parametrize("n", [1, 2, 7, 64, 256])
def test_device_prefix_sums_equal_cumsum_and_leave_the_rest_of_out(n):
    from vllm_av.core.selector import DevicePrefixSums

    g = torch.Generator().manual_seed(n)
    sums = DevicePrefixSums(256, "cpu")
    counts = torch.randint(0, 9, (n,), generator=g, dtype=torch.int32)
    out = torch.full((258,), -7, dtype=torch.int32)
    view = sums(counts, out)
    expected = torch.cat([torch.zeros(1, dtype=torch.int64), counts.long().cumsum(0)])
    assert view.shape == (n + 1,) and torch.equal(view.long(), expected)
    assert (out[n + 1:] == -7).all()  # only the prefix is written


def test_device_prefix_sums_stay_exact_at_the_largest_step():
    # 256 requests x (K + 1 = 33 tokens): integer totals far past what a
    # half-precision product would hold, still exact in float32.
    from vllm_av.core.selector import DevicePrefixSums

    sums = DevicePrefixSums(256, "cpu")
    counts = torch.full((256,), 33, dtype=torch.int32)
    out = torch.zeros(257, dtype=torch.int32)
    assert torch.equal(sums(counts, out).long(), torch.arange(257) * 33)
