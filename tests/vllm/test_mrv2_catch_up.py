"""The drafter catch-up on Model Runner V2 (vllm_av/vllm/mrv2/catch_up.py).

The ledger's windows are plain host arithmetic. The layout kernel runs
under Triton's interpreter on CPU tensors, in a subprocess (see
tests/interpreted.py): without windows its output must be vLLM's own
first-forward layout, byte for byte (vLLM's kernel runs beside it), and
with windows each request's rows must start with its missed positions'
tokens from the history. The depth patch's wiring runs on a stand-in
speculator: depth-0 steps are entered, the next drafting call sees the
widened batch and the plan, and nothing after it.
"""
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from interpreted import run_interpreted  # noqa: E402
from vllm_av.vllm.mrv2 import catch_up  # noqa: E402
from vllm_av.vllm.mrv2.catch_up import CatchUpLedger, row_shifts  # noqa: E402


def test_ledger_windows_are_the_tokens_skipped_since_the_drafter_last_ran():
    ledger = CatchUpLedger(8, K=4)
    ledger.skipped(["a", "b"], [3, 5], [1, 40])  # b: a prompt chunk at depth 0
    ledger.skipped(["a", "b"], [3, 5], [4, 1])  # a verified 3 drafts, then skipped
    w = ledger.windows(["a", "b", "c"], [3, 5, 6], [100, 100, 100], room=1000)
    assert w.tolist() == [5, 41, 0]
    assert ledger.tokens_total == 46 and ledger.dropped == 0
    # Caught up: the next drafting step reaches back nowhere.
    assert ledger.windows(["a", "b", "c"], [3, 5, 6], [100, 100, 100], 1000).tolist() == [0, 0, 0]


def test_ledger_windows_never_reach_before_the_sequence_or_past_the_buffers():
    ledger = CatchUpLedger(8, K=4)
    ledger.skipped(["a", "b", "c"], [0, 1, 2], [30, 30, 30])
    w = ledger.windows(["a", "b", "c"], [0, 1, 2], [10, 100, -4], room=35)
    # a: at most its first position (10); b: the room left (25); c: before
    # the sequence's start, nothing.
    assert w.tolist() == [10, 25, 0]
    assert ledger.tokens_total == 35 and ledger.dropped == 20 + 5 + 30


def test_a_slot_handed_to_another_request_starts_with_nothing_missed():
    ledger = CatchUpLedger(4, K=4)
    ledger.skipped(["old"], [2], [17])
    assert ledger.windows(["new"], [2], [50], 100).tolist() == [0]
    ledger.skipped(["new"], [2], [1])
    assert ledger.windows(["new"], [2], [50], 100).tolist() == [1]


def test_after_depth_0_steps_a_window_reaches_back_to_the_sequence_start():
    """The scheduler's count of computed tokens may run ahead of a request's
    first query by the rejected drafts it still holds, at most those of
    the latest steps: after steps that drafted nothing it is exact, and a
    skipped prompt is caught up whole, its first positions included."""
    K = 4
    ledger = CatchUpLedger(8, K)
    assert ledger.count_slack() == 2 * K  # nothing known yet: two steps of K
    ledger.skipped(["a"], [0], [20])  # the prompt, drafter skipped
    ledger.drafted(0)
    ledger.skipped(["a"], [0], [1])
    ledger.drafted(0)
    assert ledger.count_slack() == K  # one step not yet known
    ledger.skipped(["a"], [0], [1])
    ledger.drafted(0)
    assert ledger.count_slack() == 0
    computed = 22  # exact: no draft was scheduled
    w = ledger.windows(["a"], [0], [computed - ledger.count_slack()], room=100)
    assert w.tolist() == [22] and ledger.dropped == 0
    # Negative control, the bound without the depths (two steps of K):
    # the first 2K positions, the prompt's first tokens, stay holes.
    old = CatchUpLedger(8, K)
    old.skipped(["a"], [0], [22])
    assert old.windows(["a"], [0], [computed - 2 * K], room=100).tolist() == [14]
    assert old.dropped == 2 * K
    # Steps that drafted keep their drafts in the margin, capped at 2K.
    ledger.drafted(3)
    ledger.drafted(0)
    assert ledger.count_slack() == 3
    for _ in range(3):
        ledger.drafted(K)
    assert ledger.count_slack() == 2 * K


def test_rows_move_by_the_windows_and_correction_rows_before_them():
    assert row_shifts(np.array([2, 0, 7])).tolist() == [0, 3, 4, 12]


LAYOUT = r'''
import json, types
import numpy as np, torch, triton
import vllm.triton_utils as tu
tu.triton, tu.tl, tu.HAS_TRITON = triton, triton.language, True
import vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator as sa
from vllm_av.vllm.mrv2.catch_up import CatchUpPlan, lay_out_caught_up_inputs

R, L, MAXLEN = 8, 64, 60
g = torch.Generator().manual_seed(0)
history = torch.randint(1, 1000, (R, L), generator=g, dtype=torch.int32)
slots = [5, 2, 7]
qlens = [1, 4, 3]           # scheduled tokens: plain, 3 drafts, 2 drafts
rejected = [0, 2, 0]
starts = [20, 9, 40]        # first query position per request
qsl = np.concatenate(([0], np.cumsum(qlens))).astype(np.int32)
ids, pos = [], []
for s, q, p in zip(slots, qlens, starts):
    ids += history[s, p:p + q].tolist()
    pos += list(range(p, p + q))
n, T = len(slots), int(qsl[-1])
last_sampled = torch.zeros(R, 1, dtype=torch.int64)
for s in slots:
    last_sampled[s, 0] = 4000 + s
batch = types.SimpleNamespace(
    num_reqs=n, num_tokens=T, query_start_loc_np=qsl,
    input_ids=torch.tensor(ids, dtype=torch.int32), positions=torch.tensor(pos),
    idx_mapping=torch.tensor(slots, dtype=torch.int32),
    query_start_loc=torch.from_numpy(qsl.copy()),
    seq_lens=torch.tensor([p + q for p, q in zip(starts, qlens)], dtype=torch.int32))
num_rejected = torch.tensor(rejected)

def buffers():
    cap = T + R + 64
    return dict(
        bufs=types.SimpleNamespace(query_start_loc=torch.full((R + 1,), -1, dtype=torch.int32),
                                   seq_lens=torch.full((R,), -1, dtype=torch.int32)),
        ids=torch.full((cap,), -1, dtype=torch.int32), pos=torch.full((cap,), -1),
        last=torch.full((R,), -1))

def run(fn, b):
    total = fn(b["bufs"], batch, last_sampled, num_rejected, b["ids"], b["pos"], b["last"], R, MAXLEN)
    return {"total": int(total), "ids": b["ids"][:total].tolist(), "pos": b["pos"][:total].tolist(),
            "last": b["last"].tolist(), "qsl": b["bufs"].query_start_loc.tolist(),
            "seq_lens": b["bufs"].seq_lens.tolist()}

def ours(windows):
    plan = CatchUpPlan(np.array(windows), qsl.copy())
    return lambda *a: lay_out_caught_up_inputs(plan, history, *a)

out = {"vllm": run(sa.prepare_prefill_inputs, buffers()),
       "ours0": run(ours([0, 0, 0]), buffers()),
       "ours": run(ours([3, 0, 5]), buffers()),
       "history": history.tolist()}
# Our trimming verified 2 of request 1's 4 scheduled tokens: the device
# batch is compacted (ids, positions, query_start_loc), the host's
# query_start_loc still holds the scheduled lengths.
keep = [0, 1, 2, 5, 6, 7]
trimmed_qsl = np.array([0, 1, 3, 6], dtype=np.int32)
batch = types.SimpleNamespace(**{**vars(batch),
    "input_ids": batch.input_ids[keep], "positions": batch.positions[keep],
    "query_start_loc": torch.from_numpy(trimmed_qsl),
    "seq_lens": torch.tensor([21, 11, 43], dtype=torch.int32)})
num_rejected = torch.tensor([0, 1, 0])
out["vllm_trimmed"] = run(sa.prepare_prefill_inputs, buffers())
out["ours0_trimmed"] = run(ours([0, 0, 0]), buffers())
out["ours_trimmed"] = run(ours([3, 0, 5]), buffers())
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def laid_out():
    return json.loads(run_interpreted(LAYOUT)[-1])


def test_without_windows_the_layout_is_vllms_own(laid_out):
    assert laid_out["ours0"] == laid_out["vllm"], laid_out


def test_under_trimming_the_layout_follows_the_verified_lengths(laid_out):
    """vLLM's layout places each request by the device's (trimmed) query
    starts; without windows ours must match it row for row, and with
    windows shift it by them."""
    plain, ours0, got = (laid_out[k] for k in ("vllm_trimmed", "ours0_trimmed", "ours_trimmed"))
    end = plain["qsl"][3]  # rows past the device total belong to no request
    assert ours0["qsl"] == plain["qsl"] and ours0["last"] == plain["last"]
    assert ours0["ids"][:end] == plain["ids"][:end] and ours0["pos"][:end] == plain["pos"][:end]
    assert ours0["seq_lens"] == plain["seq_lens"] and ours0["total"] == plain["total"]
    shift = np.concatenate(([0], np.cumsum([3, 0, 5])))
    assert got["qsl"][:4] == (np.array(plain["qsl"][:4]) + shift).tolist()
    assert got["last"][:3] == (np.array(plain["last"][:3]) + shift[1:]).tolist()
    h, slots = laid_out["history"], [5, 2, 7]
    assert [got["ids"][i] for i in got["last"][:3]] == [4000 + s for s in slots]
    assert got["ids"][:3] == h[5][17:20]  # request 0's window, then its token
    assert got["ids"][got["qsl"][2]:got["qsl"][2] + 5] == h[7][35:40]


def test_windows_put_the_missed_positions_tokens_in_front(laid_out):
    h, got, plain = laid_out["history"], laid_out["ours"], laid_out["vllm"]
    windows, slots, starts, qlens = [3, 0, 5], [5, 2, 7], [20, 9, 40], [1, 4, 3]
    # Each request: its window from the history, then vLLM's rows for it.
    ids, pos = [], []
    for i, (w, s, p) in enumerate(zip(windows, slots, starts)):
        ids += h[s][p - w:p]
        pos += list(range(p - w, p))
        a, b = plain["qsl"][i], plain["qsl"][i + 1]
        ids += plain["ids"][a:b]
        pos += plain["pos"][a:b]
    assert got["ids"] == ids and got["pos"] == pos
    assert got["total"] == plain["total"] + sum(windows)
    # Query starts and the correction rows move by the windows before them.
    shift = np.concatenate(([0], np.cumsum(windows)))
    assert got["qsl"][:4] == (np.array(plain["qsl"][:4]) + shift).tolist()
    assert got["qsl"][4:] == [got["total"]] * 5
    assert got["last"][:3] == (np.array(plain["last"][:3]) + shift[1:]).tolist()
    assert got["seq_lens"] == plain["seq_lens"]  # the keys end where they did
    # The correction row holds the last sampled token.
    assert [got["ids"][i] for i in got["last"][:3]] == [4000 + s for s in slots]


@dataclasses.dataclass
class Batch:
    num_reqs: int
    req_ids: list
    idx_mapping_np: np.ndarray
    query_start_loc_np: np.ndarray
    num_tokens: int
    num_computed_tokens_np: np.ndarray
    is_prefilling_np: np.ndarray
    num_scheduled_tokens: np.ndarray


def _batch(qlens, computed, scheduled=None):
    """A V2 input batch of requests a, b; `scheduled`: their scheduled
    tokens where the host's query lengths (dealt by a trimming budget)
    differ from them."""
    qsl = np.concatenate(([0], np.cumsum(qlens)))
    return Batch(2, ["a", "b"], np.array([4, 1]), qsl, int(qsl[-1]), np.array(computed),
                 np.array([False, False]), np.array(scheduled or qlens))


def test_depth_patch_widens_the_next_drafting_call_by_what_depth_0_steps_skipped():
    import torch

    from vllm_av.vllm.mrv2.depth import MRV2DraftDepthPatch

    K = 3
    calls = []

    def orig(spec, input_batch, *a, **kw):
        calls.append((spec.num_speculative_steps, input_batch.num_tokens,
                      input_batch.query_start_loc_np.tolist(), catch_up._STATE["plan"]))
        return spec.draft_tokens[: input_batch.num_reqs]

    class Speculator:
        _orig_propose = staticmethod(orig)
        propose = MRV2DraftDepthPatch.propose

        def __init__(self, catch_up_on, max_num_tokens=92):
            self.num_speculative_steps, self.max_num_reqs = K, 8
            self.max_num_tokens = max_num_tokens
            self.draft_tokens = torch.zeros(8, K, dtype=torch.int64)
            self.expanded_input_ids = torch.zeros(max_num_tokens + 8, dtype=torch.int32)
            self._vllm_av_depth_options = (True, False, catch_up_on)

    spec = Speculator(catch_up_on=True)
    spec.propose(_batch([1, 9], [50, 9]), num_speculative_tokens=0)  # b: prompt chunk
    spec.propose(_batch([1, 1], [51, 18]), num_speculative_tokens=0)
    assert calls == []  # depth 0: the drafter never ran
    spec.propose(_batch([1, 1], [52, 19]), num_speculative_tokens=2)
    steps, tokens, qsl, plan = calls[-1]
    # Windows 2 and 10 (b's chunk and its next token): the call sees the
    # widened batch and its plan, at the scheduled depth.
    assert steps == 2 and tokens == 2 + 12 and qsl == [0, 3, 14]
    assert plan.windows.tolist() == [2, 10] and plan.query_start_loc_np.tolist() == [0, 1, 2]
    assert catch_up._STATE["plan"] is None  # cleared after the call
    spec.propose(_batch([2, 3], [53, 20]), num_speculative_tokens=K)
    assert calls[-1][1:] == (5, [0, 2, 5], None)  # nothing missed since
    # Every step's depth is in the ledger, for the next windows' bound.
    assert spec._vllm_av_catch_up.recent == [0, 2, K]
    # Negative control: without the option nothing is widened.
    calls.clear()
    off = Speculator(catch_up_on=False)
    off.propose(_batch([1, 9], [50, 9]), num_speculative_tokens=0)
    off.propose(_batch([1, 1], [51, 18]), num_speculative_tokens=K)
    assert calls == [(K, 2, [0, 1, 2], None)]
    # The widened first forward stays within the engine's token budget
    # (max_num_tokens), not the larger buffers (which hold a row more per
    # request): 2 tokens + 2 correction rows + windows <= 8.
    calls.clear()
    tight = Speculator(catch_up_on=True, max_num_tokens=8)
    tight.propose(_batch([1, 9], [50, 9]), num_speculative_tokens=0)
    tight.propose(_batch([1, 1], [51, 18]), num_speculative_tokens=K)
    assert calls[-1][3].windows.tolist() == [1, 3] and calls[-1][1] == 2 + 4


def test_a_trimmed_depth_0_step_enters_each_requests_scheduled_tokens():
    """A depth-0 step can still verify the drafts of the step before, and a
    trimming budget deals the host's query lengths round-robin: a drafted
    3 and b nothing (4 and 1 scheduled), 2 admitted, dealt 1 each (host
    lengths 2 and 2). The windows come from the scheduled 4 and 1, an
    upper bound of what each request ran; the dealt lengths would leave a
    short of the 3 drafts it may have verified."""
    import torch

    from vllm_av.vllm.mrv2.depth import MRV2DraftDepthPatch

    class Speculator:
        _orig_propose = staticmethod(lambda spec, batch, *a, **kw: None)
        propose = MRV2DraftDepthPatch.propose

        def __init__(self):
            self.num_speculative_steps, self.max_num_reqs, self.max_num_tokens = 3, 8, 92
            self.draft_tokens = torch.zeros(8, 3, dtype=torch.int64)
            self.expanded_input_ids = torch.zeros(100, dtype=torch.int32)
            self._vllm_av_depth_options = (True, False, True)

    spec = Speculator()
    spec.propose(_batch([2, 2], [50, 20], scheduled=[4, 1]), num_speculative_tokens=0)
    assert spec._vllm_av_catch_up.behind[[4, 1]].tolist() == [4, 1]
