"""The estimator's per-step work in one kernel each (Triton).

Draft confidences, one kernel per draft position.

The estimator's `predict` turns one draft position's logits [N, V] into a
feature per row (`features.draft_features`: logit(q_max) of the
temperature-scaled draft distribution), a confidence sigmoid(w * f + b_j),
and writes both where the step reads them. Written as torch operations
that is some thirty kernel launches per draft position, and on the H200 the
host spends 0.36-0.57 ms launching them (`benchmarks/mrv2_host_costs.py`),
in a step whose GPU work at one request is about 2 ms. `fused_confidences`
does the same in one Triton kernel, one program per row: logit(q_max) =
-log(sum over j != argmax of exp(l_j - l_max)), with the max left out of
the sum rather than subtracted from it, so it is exact when q_max rounds
to 1, as in draft_features. One pass over the vocabulary: the running
max carries the sum of the others. (A two-pass form, the max and then the
sum, is what ran on the H200 after the fifteenth round, at 0.14-0.18 ms of
device time per call; this form reads the logits once.)

Losslessness (DESIGN 2.5): the kernel reads the logits, never the sampled
token.

The estimator's observation of a verified step, one kernel per step:
`fused_observe` gathers each request's features from the table `predict`
filled, turns its verified and accepted counts into labels and adds the
window statistics of `OnlineAcceptanceEstimator.observe` (float64): 48
launches as torch operations (`benchmarks/mrv2_step_launches.py --torch`),
0.48-0.52 ms of host time on the H200.

Each returns False where its kernel cannot run (no CUDA tensor, no Triton,
an unexpected layout): the caller then runs the torch operations, which
stay the reference the tests compare the kernels with.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from vllm_av.core.features import FEATURE_CLIP

BLOCK = 4096

logger = logging.getLogger(__name__)

# Kernels that failed to build or launch here, by name, with the error: the
# torch operations serve from then on (a Triton that cannot build a kernel
# must not take the server down). The GPU tests assert this stays empty.
_FAILED: dict[str, str] = {}


def kernel_failures() -> dict[str, str]:
    return dict(_FAILED)


def _launch(name: str, kernel, grid, *args, **meta) -> bool:
    if name in _FAILED:
        return False
    try:
        kernel[grid](*args, **meta)
    except Exception as e:  # noqa: BLE001 - any build or launch error
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise  # the CPU tests want the error itself
        _FAILED[name] = f"{type(e).__name__}: {e}"
        logger.warning("vllm-av: the fused %s kernel failed (%s); the torch operations "
                       "serve instead", name, _FAILED[name][:300])
        return False
    return True


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def confidence_kernel(
        logits_ptr, stride_row, V,
        slot_ptr, temp_ptr, step_ptr,
        coef_ptr, feat_ptr, conf_ptr,
        R, K, conf_rows, conf_stride, clip,
        STEP_PER_ROW: tl.constexpr, BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0)
        slot = tl.load(slot_ptr + i).to(tl.int64)
        valid = slot >= 0
        slot = tl.where(valid, slot, R)  # padded rows: the scratch row R
        t = tl.load(temp_ptr + tl.minimum(slot, R - 1)).to(tl.float32)
        t = tl.where(t > 0, t, 1.0)  # greedy scored at temperature 1
        if STEP_PER_ROW:
            step = tl.load(step_ptr + i).to(tl.int64)
            row_out = i // K
        else:
            step = tl.load(step_ptr).to(tl.int64)
            row_out = i
        row = logits_ptr + i.to(tl.int64) * stride_row
        # One pass over the vocabulary: the running max and the sum of
        # every other exponential relative to it. Within a block one copy
        # of its max (its first index) is left out; a block whose max is
        # higher moves the old max into the rest, a block that ties or is
        # lower adds its own max to the rest.
        m = -float("inf")
        s = 0.0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
            x = tl.math.div_rn(x, t)
            bm = tl.max(x, 0)
            bi = tl.min(tl.where(x == bm, offs, V), 0)
            bs = tl.sum(tl.where((offs != bi) & (offs < V), tl.exp(x - bm), 0.0), 0)
            bs = tl.where(bm == -float("inf"), 0.0, bs)
            take = bm > m
            s_take = s * tl.exp(m - bm) + tl.where(m == -float("inf"), 0.0, tl.exp(m - bm)) + bs
            s_keep = s + tl.where(bm == -float("inf"), 0.0, (bs + 1.0) * tl.exp(bm - m))
            s = tl.where(take, s_take, s_keep)
            m = tl.where(take, bm, m)
        feat = tl.where(s > 0, -tl.log(s), clip)  # nothing else: certain
        feat = tl.where(m == -float("inf"), 0.0, feat)  # an all -inf row: no information
        feat = tl.where(feat != feat, 0.0, feat)  # NaN logits: no information
        feat = tl.minimum(tl.maximum(feat, -clip), clip)
        tl.store(feat_ptr + slot * K + step, feat)
        w = tl.load(coef_ptr).to(tl.float32)
        b = tl.load(coef_ptr + 1 + step).to(tl.float32)
        prob = 1.0 / (1.0 + tl.exp(-(w * feat + b)))
        ok = valid & (row_out < conf_rows)
        tl.store(conf_ptr + row_out * conf_stride + step, prob, mask=ok)

    return confidence_kernel


def _usable(logits: torch.Tensor) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True  # the interpreter runs the kernel on CPU tensors (tests)
    if not logits.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fused_confidences(
    logits: torch.Tensor,  # [N, V] draft logits, before temperature
    slots: torch.Tensor,  # [N] request-state slot, -1 for padding
    draft_step: torch.Tensor,  # 0-d (one position for all rows) or [N]
    temperature: torch.Tensor,  # [R] by request-state slot
    coefficients: torch.Tensor,  # [1 + K]: w, b_0 .. b_{K-1}
    features: torch.Tensor,  # [R + 1, K] float32, row R the scratch row
    confidence_probs: torch.Tensor,  # [rows, K] by batch row
) -> bool:
    """Write row i's feature at features[slot_i (R if padded), step_i] and
    its confidence at confidence_probs[batch row, step_i] (batch row i, or
    i // K when `draft_step` gives one position per row); padded rows write
    no confidence. Returns False, having done nothing, where the kernel
    cannot run."""
    if not _usable(logits) or logits.dim() != 2 or logits.stride(-1) != 1:
        return False
    if not features.is_contiguous() or confidence_probs.stride(-1) != 1:
        return False
    N, V = logits.shape
    if N == 0:
        return True
    R, K = features.shape[0] - 1, features.shape[1]
    return _launch(
        "confidence", _kernel(), (N,),
        logits, logits.stride(0), V,
        slots, temperature, draft_step.reshape(-1),
        coefficients, features, confidence_probs,
        R, K, confidence_probs.shape[0], confidence_probs.stride(0), FEATURE_CLIP,
        STEP_PER_ROW=draft_step.dim() > 0, BLOCK=BLOCK,
    )


@functools.cache
def _observe_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def observe_kernel(
        table_ptr, table_stride, rows_ptr, adm_ptr, acc_ptr, n,
        theta_ptr, window_ptr, totals_ptr, K, clip,
        HAS_TOTALS: tl.constexpr, FROM_SAMPLED: tl.constexpr, NCOL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        k = tl.program_id(0)  # one program per draft position
        w = tl.load(theta_ptr).to(tl.float32)
        b = tl.load(theta_ptr + 1 + k).to(tl.float32)
        resid_s = tl.zeros([BLOCK], dtype=tl.float64)
        resid_f_s = tl.zeros([BLOCK], dtype=tl.float64)
        wt_s = tl.zeros([BLOCK], dtype=tl.float64)
        wt_f_s = tl.zeros([BLOCK], dtype=tl.float64)
        wt_ff_s = tl.zeros([BLOCK], dtype=tl.float64)
        lab_s = tl.zeros([BLOCK], dtype=tl.float64)
        acc_s = tl.zeros([BLOCK], dtype=tl.float64)
        ver_s = tl.zeros([BLOCK], dtype=tl.float64)
        ver_f_s = tl.zeros([BLOCK], dtype=tl.float64)
        tot_acc = tl.zeros([BLOCK], dtype=tl.float64)
        tot_adm = tl.zeros([BLOCK], dtype=tl.float64)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inb = offs < n
            row = tl.load(rows_ptr + offs, mask=inb, other=-1).to(tl.int64)
            valid = inb & (row >= 0)
            first = tl.where(valid, tl.load(adm_ptr + offs, mask=inb, other=0).to(tl.int64), 0)
            second = tl.where(valid, tl.load(acc_ptr + offs, mask=inb, other=0).to(tl.int64), 0)
            if FROM_SAMPLED:
                # (tokens sampled = accepted + 1, drafts rejected) -> counts.
                acc_raw = tl.maximum(first - 1, 0)
                adm_raw = acc_raw + tl.maximum(second, 0)
            else:
                adm_raw = first
                acc_raw = second
            tot_acc += acc_raw.to(tl.float64)
            tot_adm += adm_raw.to(tl.float64)
            n_adm = tl.minimum(tl.maximum(adm_raw, 0), K)
            n_acc = tl.minimum(tl.maximum(acc_raw, 0), n_adm)
            f = tl.load(table_ptr + row * table_stride + k, mask=valid, other=0.0).to(tl.float32)
            f = tl.where(f != f, 0.0, f)
            f = tl.minimum(tl.maximum(f, -clip), clip)
            z = (w * f + b).to(tl.float64)
            p = 1.0 / (1.0 + tl.exp(-z))
            m = (k < tl.minimum(n_acc + 1, n_adm)).to(tl.float64)
            y = (k < n_acc).to(tl.float64)
            ver = (k < n_adm).to(tl.float64)
            f64 = f.to(tl.float64)
            resid = m * (y - p)
            wt = m * p * (1.0 - p)
            resid_s += resid
            resid_f_s += resid * f64
            wt_s += wt
            wt_f_s += wt * f64
            wt_ff_s += wt * f64 * f64
            lab_s += m
            acc_s += y
            ver_s += ver
            ver_f_s += ver * f64
        out = window_ptr + k * NCOL  # columns in _WINDOW_COLUMNS order
        tl.store(out + 0, tl.load(out + 0) + tl.sum(resid_s, 0))
        tl.store(out + 1, tl.load(out + 1) + tl.sum(resid_f_s, 0))
        tl.store(out + 2, tl.load(out + 2) + tl.sum(wt_s, 0))
        tl.store(out + 3, tl.load(out + 3) + tl.sum(wt_f_s, 0))
        tl.store(out + 4, tl.load(out + 4) + tl.sum(wt_ff_s, 0))
        tl.store(out + 5, tl.load(out + 5) + tl.sum(lab_s, 0))
        tl.store(out + 6, tl.load(out + 6) + tl.sum(acc_s, 0))
        tl.store(out + 7, tl.load(out + 7) + tl.sum(ver_s, 0))
        tl.store(out + 8, tl.load(out + 8) + tl.sum(ver_f_s, 0))
        if HAS_TOTALS:
            if k == 0:
                tl.store(totals_ptr, tl.load(totals_ptr) + tl.sum(tot_acc, 0))
                tl.store(totals_ptr + 1, tl.load(totals_ptr + 1) + tl.sum(tot_adm, 0))

    return observe_kernel


OBSERVE_BLOCK = 256


def fused_observe(
    table: torch.Tensor,  # [rows, >= K] features by request slot
    rows: torch.Tensor,  # [n] slot of each request, < 0 for padding
    num_admitted: torch.Tensor,  # [n] drafts verified
    num_accepted: torch.Tensor,  # [n] drafts accepted
    theta: torch.Tensor,  # [1 + K] float32: w, b_0 .. b_{K-1}
    window: torch.Tensor,  # [K, columns] float64, added to
    totals: torch.Tensor | None = None,  # [2] float64: += (accepted, verified)
    from_sampled: bool = False,
) -> bool:
    """Add the window statistics of the requests' verified drafts (padding
    rows add nothing) and, with `totals`, their accepted and verified
    counts as given. `from_sampled`: the two count arguments are instead
    the tokens each request sampled (accepted drafts + 1; 0 when none was
    verified) and its rejected drafts, as rejection sampling reports them,
    converted in the kernel. Returns False, having done nothing, where the
    kernel cannot run."""
    if not _usable(table) or table.dim() != 2 or table.stride(-1) != 1:
        return False
    if not (window.is_contiguous() and theta.is_contiguous()) or window.dtype != torch.float64:
        return False
    if totals is not None and (totals.dtype != torch.float64 or not totals.is_contiguous()):
        return False
    K, ncol = window.shape
    return _launch(
        "observe", _observe_kernel(), (K,),
        table, table.stride(0), rows, num_admitted, num_accepted, rows.shape[0],
        theta, window, totals if totals is not None else window, K, FEATURE_CLIP,
        HAS_TOTALS=totals is not None, FROM_SAMPLED=from_sampled, NCOL=ncol,
        BLOCK=OBSERVE_BLOCK,
    )


__all__ = ["fused_confidences", "fused_observe", "kernel_failures"]
