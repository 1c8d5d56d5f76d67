"""Model Runner V2's state as our MRV2 manager reads it, faked without vLLM,
on any device: shared by the CPU tests (tests/vllm) and the GPU tests
(tests/gpu), which need no vLLM for the manager alone."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

K = 4
R_MAX = 8


def mrv2_req_states(ids, K, max_num_reqs, device="cpu"):
    """The fields of Model Runner V2's request states our MRV2 manager reads:
    requests `ids` in slots 0.., every one past its prompt."""
    return SimpleNamespace(
        num_speculative_steps=K, device=torch.device(device), max_num_reqs=max_num_reqs,
        max_num_batched_tokens=64, req_id_to_index={r: i for i, r in enumerate(ids)},
        num_computed_tokens_np=np.full(max_num_reqs, 100, dtype=np.int32),
        prefill_len=SimpleNamespace(np=np.full(max_num_reqs, 10, dtype=np.int32)),
        all_token_ids=SimpleNamespace(gpu=torch.zeros(max_num_reqs, 128, dtype=torch.int32,
                                                      device=device)),
    )


def steep_cost():
    """Flat verification up to 8 tokens, then steep: the budget must bind."""
    from vllm_av.core.cost_model import CostModel

    verify = {1: [1.0], 4: [1.0], 8: [1.0], 9: [3.0], 64: [30.0]}
    return CostModel.from_samples(verify, {1: [0.5], 8: [0.5]})


def batch(idx, device="cpu"):
    """An input batch of request slots `idx`, in that order."""
    idx = np.asarray(idx, dtype=np.int64)
    return SimpleNamespace(num_reqs=len(idx), idx_mapping=torch.from_numpy(idx).to(device),
                           idx_mapping_np=idx)


def make_manager(ids, req_states=None, device="cpu"):
    """Our MRV2 manager over requests `ids` (K drafts, R_MAX slots), priced
    by `steep_cost`; built outside inference mode, as in the engine."""
    from vllm_av.vllm.config import AVOptions
    from vllm_av.vllm.mrv2.manager import AVManager

    rs = req_states if req_states is not None else mrv2_req_states(ids, K, R_MAX, device)
    qsl = torch.zeros(R_MAX + 1, dtype=torch.int32, device=device)
    m = AVManager(rs, qsl, num_bonus_tokens=1, max_total_logits=10_000,
                  options=AVOptions(metrics_dir=""))
    m.cost = steep_cost()
    for i in range(len(ids)):
        m.add_request(i)
    return m


def manager_step(m, ids, drafts):
    """One engine step: budget from stale scores, compaction, selection.
    Returns (budget, tokens, admitted per request, cu_num_logits,
    query_start_loc), the last three on the host."""
    per_req = {r: 1 + d for r, d in zip(ids, drafts)}
    draft_tokens = {r: [0] * d for r, d in zip(ids, drafts) if d}
    num_tokens = m.get_num_tokens(per_req, draft_tokens)
    budget = m._batch[3]
    sched = np.array([per_req[r] for r in ids], dtype=np.int32)
    nd = np.array(drafts, dtype=np.int32)
    cu_np = np.concatenate([[0], np.cumsum(nd + 1)]).astype(np.int32)
    compact, _ = m.compact_batch(nd, sched, cu_np)
    assert int(compact.sum()) == num_tokens
    idx = torch.tensor([m.req_states.req_id_to_index[r] for r in ids], device=m.device)
    cu, qsl, b = m.reallocate_drafts(ids, idx)
    assert b == budget
    cu, qsl = cu.cpu(), qsl.cpu()
    admitted = (cu[1:] - cu[:-1] - 1).numpy()
    return budget, num_tokens, admitted, cu.numpy(), qsl.numpy()


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def warm_on_fresh_tensors(m):
    """The warm-up before `AVManager._warm_admission`: the selector alone,
    on fresh tensors (made in inference mode): the negative control."""
    m._select(torch.ones(m.R, K, device=m.device),
              torch.full((m.R,), K, dtype=torch.int32, device=m.device), 1)


def first_trimmed_step(m, ids, warm: str):
    """Warm `m` (`admission`: its own warm-up; `fresh_tensors`: the one
    before), then, in inference mode as vLLM's execute_model, two steps'
    confidences and a step whose budget trims. Returns (budget, admitted,
    the selector's admission on the same scores, graphs compiled by the
    warm-up, graphs compiled by the trimmed step)."""
    from vllm_av.core.selector import select_admitted

    conf = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5], [0.99, 0.2, 0.9, 0.9]],
                        device=m.device)
    before = graphs_compiled()
    with torch.inference_mode():
        m._warm_admission() if warm == "admission" else warm_on_fresh_tensors(m)
        warmed = graphs_compiled()
        m.record_confidences(conf, batch([0, 1, 2], m.device))
        m.record_confidences(conf, batch([0, 1, 2], m.device))
        budget, _, admitted, _, _ = manager_step(m, ids, [K, K, K])
    want = select_admitted(torch.cumprod(conf.cpu(), 1), torch.full((3,), K), budget).numpy()
    return budget, admitted, want, warmed - before, graphs_compiled() - warmed
