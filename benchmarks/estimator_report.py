"""Acceptance-estimator report on the real draft traces (DESIGN 6).

Reads shared/data/traces/traces_<dataset>.npz (numpy, no pickle) and scores
predictors of per-slot acceptance on the labelled (uncensored) drafts:

  Reference (part 1), all scored on the held-out prompts:
    online (ours)    OnlineAcceptanceEstimator replayed in trace order, one
                     step at a time, each step scored with the prediction
                     made BEFORE that step was observed (prequential): the
                     default (running precision, memory 3000) and the plain
                     damped step of the reference design (memory=0);
    offline fits     sigmoid(w * f + b_pos) fitted on the training prompts for
                     f = logit(q_max), top-2 margin, entropy;
    q_max            used as-is, no fit (the usual reference);
    q_sampled        offline fit, NOT lossless (depends on the drafted token):
                     reference only;
    oracle           sum_v min(p_v, q_v), the exact conditional acceptance
                     probability (needs the target: an unattainable ceiling).
  Improvements (part 2): lossless alternatives, held-out by prompt.
  Cold start (part 3): labelled drafts until the running ECE is under 0.02.
  New-request prior: survival scores for a request with no history.

The bootstrap differences are against the plain reference step (memory=0).

Split: prompts (not rows) are shuffled with a fixed seed; half train, half
test. Pooled = both datasets; offline fits are then fitted on both training
halves, and the online predictions are the union of the two per-dataset
replays (each dataset is its own stream).

    PYTHONPATH=. python benchmarks/estimator_report.py

Writes docs/estimator_report.md, benchmarks/results/estimator_report.json and
docs/img/estimator_reliability.png. About 22 s of CPU time (single-threaded torch);
~40 s wall on a busy 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from vllm_av.core.estimator import OnlineAcceptanceEstimator
from vllm_av.core.metrics import (
    expected_calibration_error,
    log_loss,
    reliability_bins,
    roc_auc,
)

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "data" / "traces"
DATASETS = ("humaneval", "mtbench")
K = 7  # num_speculative_tokens of the traces (meta_json "K")
SPLIT_SEED = 0  # prompt shuffle for the train/test split
ECE_BINS = 10
# Cold start: ECE over the last COLD_WINDOW labelled drafts. Scored against
# the expected acceptance sum_v min(p_v, q_v) (the exact probability the slot
# is accepted given its context): with 0/1 labels a 500-draft window has a
# sampling-noise floor near 0.02 that even the oracle does not beat, so a
# hard-label crossing time would measure noise, not the estimator.
COLD_WINDOW = 500
COLD_THRESHOLD = 0.02
HARD_WINDOW = 1000  # hard-label variant of the same curve (reported too)
COLD_ORDERS = 3  # trace order + 2 shuffled prompt orders (first crossing is noisy)
COLD_MAX_LABELLED = 3000  # the shuffled replays stop here (crossings come earlier)
BOOTSTRAP = 2000  # prompt-level bootstrap resamples for log-loss differences
BATCH_SIZES = (8, 32)  # interleaved-prompt replays (a server batch)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- data
def load_trace(dataset: str) -> dict[str, np.ndarray]:
    """Per-drafted-slot arrays (pos_ prefix dropped), in replay order
    (prompt_idx, step, position), plus derived columns."""
    z = np.load(TRACES / f"traces_{dataset}.npz", allow_pickle=False)
    order = np.lexsort((z["pos_position"], z["pos_step"], z["pos_prompt_idx"]))
    t = {k[4:]: z[k][order] for k in z.files if k.startswith("pos_")}
    t["labelled"] = ~t["censored"]
    t["y"] = (t["accepted"] == 1).astype(np.float64)
    # logit(q_sampled) from log q, stably; NOT lossless (reference only).
    lq = np.minimum(t["log_q_sampled"].astype(np.float64), -1e-12)
    t["logit_q_sampled"] = np.clip(lq - np.log1p(-np.exp(lq)), -30.0, 30.0)
    # logit(q_max) of the previous slot in the same step (0 at position 0):
    # q_{i-1} is fixed before x_i is drafted, so this is lossless.
    prev = np.r_[0.0, t["logit_q_max"][:-1]].astype(np.float64)
    t["prev_logit_q_max"] = np.where(t["position"] == 0, 0.0, prev)
    return t


def concat(a: dict, b: dict) -> dict:
    """Two traces as one stream (b's prompt indices shifted past a's)."""
    shift = int(a["prompt_idx"].max()) + 1
    return {k: np.concatenate([a[k], b[k] + shift if k == "prompt_idx" else b[k]])
            for k in a}


def step_bounds(t: dict) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) row ranges of the steps, in replay order."""
    key = t["prompt_idx"].astype(np.int64) * 1_000_000 + t["step"]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    return starts, np.r_[starts[1:], key.size]


def test_mask(t: dict, seed: int = SPLIT_SEED) -> np.ndarray:
    """Rows of the held-out half of the prompts (split by prompt, not row)."""
    prompts = np.unique(t["prompt_idx"])
    held_out = np.random.default_rng(seed).permutation(prompts)[: prompts.size // 2]
    return np.isin(t["prompt_idx"], held_out)


def reorder_prompts(t: dict, seed: int, max_labelled: int | None = None) -> dict:
    """The same trace with its prompts in a shuffled order (steps and slots
    inside a prompt keep their order), cut after `max_labelled` labelled
    drafts (at a step boundary)."""
    prompts = np.random.default_rng(seed).permutation(np.unique(t["prompt_idx"]))
    rank = np.empty(prompts.max() + 1, np.int64)
    rank[prompts] = np.arange(prompts.size)
    order = np.lexsort((t["position"], t["step"], rank[t["prompt_idx"]]))
    out = {k: v[order] for k, v in t.items()}
    out["prompt_idx"] = rank[out["prompt_idx"]]  # replay order = index order
    if max_labelled is not None:
        starts, _ = step_bounds(out)
        cut_steps = starts[np.cumsum(out["labelled"])[starts] > max_labelled]
        if cut_steps.size:
            out = {k: v[: cut_steps[0]] for k, v in out.items()}
    return out


# -------------------------------------------------------------- offline fits
def design(t: dict, features: list[str], per_position_slope: bool = False) -> np.ndarray:
    """[n, F (+F*K) + K]: features, optional per-position slope offsets, one-hot
    position (the per-position intercepts)."""
    onehot = np.eye(K)[t["position"].astype(int)]
    cols = [t[f].astype(np.float64)[:, None] for f in features]
    if per_position_slope:
        cols += [t[f].astype(np.float64)[:, None] * onehot for f in features]
    return np.hstack(cols + [onehot])


def fit_logistic(X: np.ndarray, y: np.ndarray, penalty: np.ndarray | float = 1e-3):
    """Penalised logistic regression by Newton's method: theta [F]."""
    pen = np.broadcast_to(np.asarray(penalty, dtype=np.float64), (X.shape[1],))
    theta = np.zeros(X.shape[1])
    for _ in range(100):
        p = 1.0 / (1.0 + np.exp(-(X @ theta)))
        grad = X.T @ (y - p) - pen * theta
        hess = (X * (p * (1 - p))[:, None]).T @ X + np.diag(pen)
        step = np.linalg.solve(hess, grad)
        theta += step
        if np.abs(step).max() < 1e-10:
            break
    return theta


def fit_predict(t: dict, train: np.ndarray, features: list[str],
                per_position_slope: bool = False, shrinkage: float = 0.0):
    """Fit on labelled train rows, predict every row. `shrinkage` is the ridge
    on the per-position slope offsets (pulls them toward the shared slope)."""
    X = design(t, features, per_position_slope)
    pen = np.full(X.shape[1], 1e-3)
    if per_position_slope:
        nf = len(features)
        pen[nf : nf + nf * K] = max(shrinkage, 1e-3)
    rows = train & t["labelled"]
    theta = fit_logistic(X[rows], t["y"][rows], pen)
    return 1.0 / (1.0 + np.exp(-(X @ theta))), theta


# ------------------------------------------------------------ online replays
def replay_online(t: dict, est, feature: str = "logit_q_max") -> dict[str, np.ndarray]:
    """Batch-1 replay in trace order: predict a step, then observe it.

    Returns per-row predictions and, per prompt's first step, the survival
    prior the estimator would give a new request (prior_survival) and the
    model's survival at the mean feature (the previous prior_survival)."""
    f = t[feature].astype(np.float32)
    preds = np.empty(f.size)
    prior = np.full(f.size, np.nan)  # filled on first-step rows only
    model_prior = np.full(f.size, np.nan)
    for s, e in zip(*step_bounds(t)):
        x = torch.from_numpy(f[s:e]).unsqueeze(0)  # [1, n_drafted]
        if s == 0 or t["prompt_idx"][s] != t["prompt_idx"][s - 1]:  # new request
            prior[s:e] = est.prior_survival(e - s).numpy()
            model = est.predict(est.mean_features[: e - s].unsqueeze(0))[0]
            model_prior[s:e] = torch.cumprod(model, 0).numpy()
        preds[s:e] = est.predict(x)[0].numpy()
        n_acc = int(t["y"][s:e].sum())  # accepted = labelled 1s (a prefix)
        est.observe(x, num_admitted=torch.tensor([e - s]), num_accepted=torch.tensor([n_acc]))
    return {"pred": preds, "prior": prior, "model_prior": model_prior}


def replay_batched(t: dict, est, batch: int, feature: str = "logit_q_max") -> np.ndarray:
    """Replay with `batch` prompts decoding side by side: each engine step
    takes the next step of every running prompt ([R, K] features, padded); a
    finished prompt's slot goes to the next prompt in order."""
    f = t[feature].astype(np.float32)
    starts, ends = step_bounds(t)
    pid = t["prompt_idx"][starts]
    queues = [list(zip(starts[pid == p], ends[pid == p])) for p in np.unique(pid)]
    preds = np.empty(f.size)
    slots: list[list] = [[] for _ in range(batch)]
    next_prompt = 0
    while True:
        for i in range(batch):
            if not slots[i] and next_prompt < len(queues):
                slots[i], next_prompt = queues[next_prompt], next_prompt + 1
        cur = [q.pop(0) for q in slots if q]
        if not cur:
            return preds
        x = torch.zeros(len(cur), K)  # [R, K]; padding past n_drafted is never read
        for r, (s, e) in enumerate(cur):
            x[r, : e - s] = torch.from_numpy(f[s:e])
        p = est.predict(x).numpy()
        for r, (s, e) in enumerate(cur):
            preds[s:e] = p[r, : e - s]
        est.observe(x, num_admitted=torch.tensor([e - s for s, e in cur]),
                    num_accepted=torch.tensor([int(t["y"][s:e].sum()) for s, e in cur]))


# ------------------------------------------------------------------- scoring
def metrics(p: np.ndarray, y: np.ndarray, auc_scores: np.ndarray | None = None) -> dict:
    """AUC, log-loss, ECE and count; AUC on `auc_scores` if given."""
    return {
        "auc": roc_auc(p if auc_scores is None else auc_scores, y),
        "log_loss": log_loss(p, y),
        "ece": expected_calibration_error(p, y, num_bins=ECE_BINS),
        "n": int(y.size),
    }


def score(t: dict, pred: np.ndarray, rows: np.ndarray) -> dict:
    """Overall and per-position metrics of `pred` on labelled `rows`."""
    rows = rows & t["labelled"]
    pos = t["position"]
    return {
        "overall": metrics(pred[rows], t["y"][rows]),
        "per_position": [metrics(pred[rows & (pos == i)], t["y"][rows & (pos == i)])
                         for i in range(K)],
    }


# ----------------------------------------------------------------- part 1
REFERENCE = (
    # (key, label, feature or None)
    ("online", "online estimator (ours, default), logit(q_max)", None),
    ("online_plain", "online estimator, memory=0 (plain damped step, reference design)", None),
    ("logit_q_max", "logit(q_max), offline fit", "logit_q_max"),
    ("q_max", "q_max as-is, no fit", None),
    ("top2_margin", "top-2 margin, offline fit", "top2_margin"),
    ("entropy", "entropy, offline fit", "entropy"),
    ("q_sampled", "q_sampled, offline fit (not lossless: reference only)", "logit_q_sampled"),
    ("oracle", "oracle sum min(p,q) (needs the target: ceiling)", None),
)


def reference_predictions(t: dict, train: np.ndarray, online: np.ndarray,
                          online_plain: np.ndarray) -> dict:
    """Every reference method's prediction for every row of `t`."""
    preds = {"online": online, "online_plain": online_plain, "q_max": t["q_max"].astype(np.float64),
             "oracle": np.clip(t["exp_accept"].astype(np.float64), 0.0, 1.0)}
    for key, _label, feature in REFERENCE:
        if feature is not None:
            preds[key] = fit_predict(t, train, [feature])[0]
    return preds


# ----------------------------------------------------------------- part 2
OFFLINE_VARIANTS = (
    ("logit(q_max) (baseline form)", ["logit_q_max"], False, 0.0),
    ("logit(q_max) + entropy", ["logit_q_max", "entropy"], False, 0.0),
    ("logit(q_max) + entropy + margin", ["logit_q_max", "entropy", "top2_margin"], False, 0.0),
    ("logit(q_max) + previous slot's logit(q_max)", ["logit_q_max", "prev_logit_q_max"], False, 0.0),
    ("per-position slope, no shrinkage", ["logit_q_max"], True, 0.0),
    ("per-position slope, shrinkage 10", ["logit_q_max"], True, 10.0),
    ("per-position slope, shrinkage 100", ["logit_q_max"], True, 100.0),
)


DEFAULT = "default (memory 3000, refit 8, no damping)"
DEFAULT_PRIOR = "default + prior from other dataset (w, per-position b)"
PLAIN = "memory=0: plain damped step (refit 8, damping 100; reference design)"
PLAIN_PRIOR = "memory=0 + prior from other dataset (w, mean b)"


def online_variants(other_theta: np.ndarray) -> list[tuple[str, object]]:
    """(label, fresh estimator) pairs; `other_theta` = [w, b_0..b_{K-1}] fitted
    offline on the other dataset (a prior from an earlier run of the pair)."""
    w, b = float(other_theta[0]), [float(v) for v in other_theta[1:]]
    est = OnlineAcceptanceEstimator
    return [
        (DEFAULT, est(K)),
        ("default, memory inf", est(K, memory=float("inf"))),
        ("default, prior precision (ridge) 10", est(K, ridge=10.0)),
        ("default + damping 100 (forgotten label counts)", est(K, damping=100.0)),
        ("default, refit every step", est(K, refit_interval=1)),
        (DEFAULT_PRIOR, est(K, slope=w, intercept=b)),
        (PLAIN, est(K, memory=0)),
        ("memory=0, refit every step (larger early steps)", est(K, memory=0, refit_interval=1)),
        ("memory=0, refit every 2 steps", est(K, memory=0, refit_interval=2)),
        (PLAIN_PRIOR, est(K, memory=0, slope=w, intercept=float(np.mean(b)))),
    ]


# ----------------------------------------------------------------- part 3
def running_ece(pred: np.ndarray, target: np.ndarray, window: int) -> np.ndarray:
    """ECE of the last `window` labelled drafts after each one (NaN before
    the window is full). `target` is 0/1 labels or expected acceptance."""
    out = np.full(pred.size, np.nan)
    for n in range(window, pred.size + 1, 10):  # every 10th draft is enough
        out[n - 1] = expected_calibration_error(pred[n - window : n], target[n - window : n], ECE_BINS)
    return out


def cold_start(curve: np.ndarray, threshold: float = COLD_THRESHOLD) -> dict:
    """Labelled drafts until the running ECE first drops under `threshold`
    (None: never), and the share of later windows that are under it."""
    valid = np.flatnonzero(~np.isnan(curve))
    below = curve[valid] < threshold
    if not below.any():
        return {"first_below": None, "share_below_after": 0.0}
    i = int(np.argmax(below))
    return {"first_below": int(valid[i] + 1), "share_below_after": float(below[i:].mean())}


def prompt_bootstrap(t: dict, p_new: np.ndarray, p_base: np.ndarray, seed: int = 0) -> dict:
    """Log-loss difference new - base over labelled rows with a 95% interval
    from resampling prompts (rows of one prompt are not independent)."""
    lab = t["labelled"]
    y = t["y"][lab]
    loss = lambda p: -(y * np.log(np.clip(p, 1e-15, 1)) + (1 - y) * np.log(np.clip(1 - p, 1e-15, 1)))
    diff = loss(p_new[lab]) - loss(p_base[lab])
    _, pid = np.unique(t["prompt_idx"][lab], return_inverse=True)
    sums, counts = np.bincount(pid, weights=diff), np.bincount(pid).astype(float)
    draws = np.random.default_rng(seed).integers(0, sums.size, (BOOTSTRAP, sums.size))
    boot = sums[draws].sum(1) / counts[draws].sum(1)
    return {"diff": float(diff.mean()), "ci95": [float(v) for v in np.percentile(boot, [2.5, 97.5])]}


def new_request_priors(t: dict, replays: dict[str, dict]) -> dict:
    """Survival priors for a request with no history, scored on each prompt's
    first step: Brier score of S_i against 'slots 0..i all accepted' and the
    mean error of the expected accepted length sum_i S_i."""
    starts, ends = step_bounds(t)
    pid, pos, lab = t["prompt_idx"], t["position"], t["labelled"]
    first = [(s, e) for s, e in zip(starts, ends) if s == 0 or pid[s] != pid[s - 1]]
    named = {  # the replays' priors, by the name they get in the table
        # The observed rates do not depend on the step rule (memory=0 keeps
        # them over DEFAULT_MEMORY labels too), so one row covers both.
        "prior_survival (observed rates, memory 3000)": replays["default"]["prior"],
        "model at mean feature, default fit": replays["default"]["model_prior"],
        "model at mean feature, memory=0 fit (previous prior_survival)":
            replays["plain"]["model_prior"],
    }
    out = {name: [] for name in ["upstream 1.0", *named,
                                 "running per-position acceptance (numpy reference)"]}
    for s, e in first:
        reached = np.cumprod(t["y"][s:e])  # slot i and all before it accepted
        # Running conditional acceptance per position over the earlier prompts
        # (rows before s: the stream is in prompt order), cumprod -> survival.
        rate = [t["y"][:s][lab[:s] & (pos[:s] == i)].mean()
                if (lab[:s] & (pos[:s] == i)).any() else 1.0 for i in range(e - s)]
        cands = {"upstream 1.0": np.ones(e - s),
                 **{name: prior[s:e] for name, prior in named.items()},
                 "running per-position acceptance (numpy reference)": np.cumprod(rate)}
        for name, surv in cands.items():
            out[name].append((np.mean((surv - reached) ** 2), surv.sum() - reached.sum()))
    return {name: {"brier": float(np.mean([b for b, _ in v])),
                   "accepted_len_bias": float(np.mean([d for _, d in v])),
                   "accepted_len_mae": float(np.mean([abs(d) for _, d in v])),
                   "n_prompts": len(v)}
            for name, v in out.items()}


# ---------------------------------------------------------------- markdown
def md_table(headers: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else ("-" if v is None else str(v))
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def overall_row(label: str, m: dict) -> list:
    return [label, m["auc"], m["log_loss"], m["ece"], m["n"]]


def per_position_table(scores: dict) -> str:
    headers = ["method"] + [f"pos {i}" for i in range(K)]
    rows = []
    for key, label, _ in REFERENCE:
        pp = scores[key]["per_position"]
        rows.append([label] + [f"{m['auc']:.3f} / {m['log_loss']:.3f} / {m['ece']:.3f}" for m in pp])
    n = [str(m["n"]) for m in scores["q_max"]["per_position"]]
    rows.append(["labelled drafts (test)"] + n)
    return md_table(headers, rows)


def plot_reliability(curves: dict, path: Path) -> None:
    """One panel per dataset: observed acceptance vs mean prediction per bin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4.6), sharey=True)
    for ax, (name, methods) in zip(axes, curves.items()):
        ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--")
        for label, (p, y) in methods.items():
            b = reliability_bins(p, y, ECE_BINS)
            used = b["count"] >= 10
            ax.plot(b["mean_predicted"][used], b["observed"][used], "o-", ms=4, label=label)
        ax.set_title(f"{name} (held-out prompts)")
        ax.set_xlabel("mean predicted acceptance")
        ax.set_xlim(0, 1), ax.set_ylim(0, 1)
    axes[0].set_ylabel("observed acceptance")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--md", default=str(REPO / "docs" / "estimator_report.md"))
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "estimator_report.json"))
    ap.add_argument("--png", default=str(REPO / "docs" / "img" / "estimator_reliability.png"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    t0 = time.time()

    log("[1/6] loading traces")
    traces = {d: load_trace(d) for d in DATASETS}
    tests = {d: test_mask(t) for d, t in traces.items()}
    traces["pooled"] = concat(traces["humaneval"], traces["mtbench"])
    tests["pooled"] = np.concatenate([tests[d] for d in DATASETS])
    full_fit = {d: fit_predict(traces[d], np.ones(traces[d]["y"].size, bool), ["logit_q_max"])[1]
                for d in DATASETS}

    log("[2/6] reference methods (online replay + offline fits)")
    online = {d: {"default": replay_online(traces[d], OnlineAcceptanceEstimator(K)),
                  "plain": replay_online(traces[d], OnlineAcceptanceEstimator(K, memory=0))}
              for d in DATASETS}
    online["pooled"] = {m: {"pred": np.concatenate([online[d][m]["pred"] for d in DATASETS])}
                        for m in ("default", "plain")}
    ref_scores, ref_preds, online_all = {}, {}, {}
    for d, t in traces.items():
        ref_preds[d] = reference_predictions(t, ~tests[d], online[d]["default"]["pred"],
                                             online[d]["plain"]["pred"])
        ref_scores[d] = {k: score(t, p, tests[d]) for k, p in ref_preds[d].items()}
        online_all[d] = {m: score(t, online[d][m]["pred"], np.ones(t["y"].size, bool))
                         for m in ("default", "plain")}

    log("[3/6] improvements: offline feature sets (fit on train prompts)")
    offline_imp = {d: {label: score(traces[d], fit_predict(traces[d], ~tests[d], feats, pps, shr)[0],
                                    tests[d])["overall"]
                       for label, feats, pps, shr in OFFLINE_VARIANTS} for d in DATASETS}

    log("[4/6] improvements: online variants (batch 1, batch 8/32, drift)")
    online_imp, online_preds = {}, {}
    for d in DATASETS:
        other = [o for o in DATASETS if o != d][0]
        t = traces[d]
        online_imp[d], online_preds[d] = {}, {}
        for label, est in online_variants(full_fit[other]):
            replay = replay_online(t, est)
            p = online_preds[d][label] = replay["pred"]
            everything = np.ones(t["y"].size, bool)
            online_imp[d][label] = {"test": score(t, p, tests[d])["overall"],
                                    "all": score(t, p, everything)["overall"]}
        for b in BATCH_SIZES:
            for label, est in (("default", OnlineAcceptanceEstimator(K)),
                               ("memory=0", OnlineAcceptanceEstimator(K, memory=0))):
                p = replay_batched(t, est, b)
                online_imp[d][f"batch {b}: {label}"] = {
                    "all": score(t, p, np.ones(t["y"].size, bool))["overall"]}
    drift = {}
    for a, b in (DATASETS, DATASETS[::-1]):
        t = concat(traces[a], traces[b])
        second = np.r_[np.zeros(traces[a]["y"].size, bool), np.ones(traces[b]["y"].size, bool)]
        for label, est in (("default (memory 3000)", OnlineAcceptanceEstimator(K)),
                           ("default, memory inf", OnlineAcceptanceEstimator(K, memory=float("inf"))),
                           ("memory=0", OnlineAcceptanceEstimator(K, memory=0))):
            p = replay_online(t, est)["pred"]
            drift[f"{a} then {b}: {label}"] = score(t, p, second)["overall"]

    log("[5/6] cold start and new-request priors")
    cold = {}
    cold_labels = (PLAIN, PLAIN_PRIOR, DEFAULT, DEFAULT_PRIOR)
    for d in DATASETS:
        t, lab = traces[d], traces[d]["labelled"]
        soft = np.clip(t["exp_accept"][lab].astype(np.float64), 0, 1)
        fixed = fit_predict(t, np.ones(t["y"].size, bool), ["logit_q_max"])[0][lab]
        cold[d] = {"n_labelled": int(lab.sum()),
                   "oracle, hard labels": cold_start(running_ece(soft, t["y"][lab], HARD_WINDOW)),
                   "fixed offline fit (in-sample)": {
                       "soft": cold_start(running_ece(fixed, soft, COLD_WINDOW)),
                       "hard": cold_start(running_ece(fixed, t["y"][lab], HARD_WINDOW))}}
        shuffled = [reorder_prompts(t, seed, COLD_MAX_LABELLED) for seed in range(1, COLD_ORDERS)]
        other = [o for o in DATASETS if o != d][0]
        for label in cold_labels:
            p = online_preds[d][label][lab]
            firsts = [cold_start(running_ece(p, soft, COLD_WINDOW))["first_below"]]
            for ts in shuffled:  # the same estimator on other prompt orders
                est = dict(online_variants(full_fit[other]))[label]
                ps = replay_online(ts, est)["pred"][ts["labelled"]]
                firsts.append(cold_start(running_ece(
                    ps, np.clip(ts["exp_accept"][ts["labelled"]].astype(np.float64), 0, 1),
                    COLD_WINDOW))["first_below"])
            cold[d][label] = {
                "soft": cold_start(running_ece(p, soft, COLD_WINDOW)),
                "hard": cold_start(running_ece(p, t["y"][lab], HARD_WINDOW)),
                "soft_first_by_order": firsts,
            }
    boot = {d: {label: prompt_bootstrap(traces[d], online_preds[d][label],
                                        online_preds[d][PLAIN])
                for label in cold_labels[1:]} for d in DATASETS}
    priors = {d: new_request_priors(traces[d], online[d]) for d in DATASETS}

    log("[6/6] writing outputs")
    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    command = "PYTHONPATH=. python benchmarks/estimator_report.py"
    md = render_markdown(date, command, ref_scores, online_all, offline_imp, online_imp,
                         drift, cold, priors, boot)
    print(md)
    Path(args.md).parent.mkdir(parents=True, exist_ok=True)
    Path(args.md).write_text(md + "\n")
    result = {"date": date, "command": command, "split_seed": SPLIT_SEED, "ece_bins": ECE_BINS,
              "reference": ref_scores, "online_all_rows": online_all,
              "offline_improvements": offline_imp, "online_improvements": online_imp,
              "drift": drift, "cold_start": cold, "bootstrap_vs_default": boot, "new_request_priors": priors,
              "full_fit_logit_q_max": {d: v.tolist() for d, v in full_fit.items()}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, default=float) + "\n")
    curves = {}
    for d, t in traces.items():
        rows = tests[d] & t["labelled"]
        curves[d] = {"q_max, no fit": (ref_preds[d]["q_max"][rows], t["y"][rows]),
                     "online, default (memory 3000)": (ref_preds[d]["online"][rows], t["y"][rows]),
                     "online, memory=0 (reference step)":
                         (ref_preds[d]["online_plain"][rows], t["y"][rows]),
                     "logit(q_max), offline fit": (ref_preds[d]["logit_q_max"][rows], t["y"][rows])}
    plot_reliability(curves, Path(args.png))
    log(f"done in {time.time() - t0:.1f} s: {args.md}, {args.json}, {args.png}")


def render_markdown(date, command, ref_scores, online_all, offline_imp, online_imp,
                    drift, cold, priors, boot) -> str:
    """The whole report as Markdown."""
    out = [
        "# Acceptance-estimator report",
        "",
        f"Generated {date} by `{command}` (numbers below are produced by the script;",
        "edit the script, not this file). Traces: `shared/data/traces` (Qwen2.5-Coder",
        "0.5B draft, 1.5B target, K=7, temperature 1). Labelled (uncensored) drafts",
        "only. Split by prompt (seed 0): half the prompts train the offline fits,",
        "every method is scored on the other half. The online estimator is replayed",
        "over the whole stream in trace order (prompt, step, position) at batch 1;",
        "each step is scored with the prediction made before it was observed.",
        "Pooled: offline fits on both training halves; online = the two per-dataset",
        f"replays together. ECE: {ECE_BINS} equal-width bins.",
        "",
        "![reliability](img/estimator_reliability.png)",
        "",
        "## 1. Reference: overall, held-out prompts",
    ]
    for d, s in ref_scores.items():
        out += ["", f"### {d}", "",
                md_table(["method", "AUC", "log-loss", "ECE", "n"],
                         [overall_row(label, s[key]["overall"]) for key, label, _ in REFERENCE]
                         + [overall_row("online (ours, default), all prompts of the stream",
                                        online_all[d]["default"]["overall"]),
                            overall_row("online, memory=0 (reference design), all prompts",
                                        online_all[d]["plain"]["overall"])])]
    out += ["", "## 1b. Per position (AUC / log-loss / ECE), held-out prompts"]
    for d, s in ref_scores.items():
        out += ["", f"### {d}", "", per_position_table(s)]

    out += ["", "## 2. Improvements (lossless), held-out by prompt", "",
            "### 2a. Offline model forms (fit on train prompts, scored on test prompts)", ""]
    rows = [[label] + [v for d in offline_imp for v in
                       (offline_imp[d][label]["auc"], offline_imp[d][label]["log_loss"],
                        offline_imp[d][label]["ece"])]
            for label in offline_imp[DATASETS[0]]]
    out.append(md_table(["model"] + [f"{d} {m}" for d in offline_imp for m in ("AUC", "LL", "ECE")], rows))
    out += ["", "### 2b. Online estimators (batch-1 replay; 'test' = held-out prompts' rows of the",
            "stream, 'all' = every labelled draft; batch rows: prompts interleaved)", ""]
    labels = list(online_imp[DATASETS[0]])
    rows = []
    for label in labels:
        row = [label]
        for d in DATASETS:
            r = online_imp[d][label]
            test = r.get("test")
            row += [test["log_loss"] if test else None, r["all"]["auc"], r["all"]["log_loss"], r["all"]["ece"]]
        rows.append(row)
    out.append(md_table(["estimator"] + [f"{d} {m}" for d in DATASETS
                                         for m in ("test LL", "all AUC", "all LL", "all ECE")], rows))
    out += ["", "Batch-1 log-loss difference against the plain reference step (memory=0) over",
            "all labelled drafts,",
            f"with a 95% interval from {BOOTSTRAP} prompt-level bootstrap resamples:", "",
            md_table(["estimator"] + [f"{d} {m}" for d in DATASETS for m in ("diff", "95% CI")],
                     [[label] + [v for d in DATASETS for v in
                                 (boot[d][label]["diff"],
                                  "[{:+.4f}, {:+.4f}]".format(*boot[d][label]["ci95"]))]
                      for label in boot[DATASETS[0]]])]
    out += ["", "### 2c. Drift: one stream, dataset A then dataset B (scored on B)", "",
            md_table(["stream: estimator", "AUC", "log-loss", "ECE", "n"],
                     [overall_row(k, v) for k, v in drift.items()])]

    out += ["", "## 3. Cold start", "",
            f"Running ECE = ECE over the last {COLD_WINDOW} labelled drafts in stream order,",
            f"{ECE_BINS} bins on the prediction, each bin's mean prediction against its mean",
            "expected acceptance sum_v min(p_v, q_v) (the exact acceptance probability of the",
            "slot given its context: no Bernoulli noise). 'first' = labelled drafts until it",
            f"first drops under {COLD_THRESHOLD} ('-' = never); 'share after' = share of the later",
            "windows (every 10th draft) that are under it: windows span 3-5 prompts whose",
            "acceptance differs, so even a fixed fit on all the data is not under it everywhere.",
            f"'orders': 'first' on the trace's prompt order and {COLD_ORDERS - 1} shuffled prompt orders",
            f"(first {COLD_MAX_LABELLED} labelled drafts). Hard labels: window {HARD_WINDOW}, 0/1 labels;",
            "the oracle's hard-label row is the sampling-noise floor.", ""]
    rows = []
    for d in DATASETS:
        c = cold[d]
        for label, v in c.items():
            if not isinstance(v, dict) or "soft" not in v:
                continue
            orders = ", ".join("-" if f is None else str(f) for f in v.get("soft_first_by_order", []))
            rows.append([d, label, v["soft"]["first_below"], v["soft"]["share_below_after"],
                         orders or None, v["hard"]["first_below"], v["hard"]["share_below_after"]])
        o = c["oracle, hard labels"]
        rows.append([d, "oracle (noise floor, hard labels)", None, None, None,
                     o["first_below"], o["share_below_after"]])
    out.append(md_table(["dataset", "estimator", "soft: first", "soft: share after", "soft: first, orders",
                         "hard: first", "hard: share after"], rows))
    first = lambda d, label: cold[d][label]["soft"]["first_below"]
    orders = lambda d, label: ", ".join("-" if f is None else str(f)
                                        for f in cold[d][label]["soft_first_by_order"])
    out += ["", f"With the default (memory 3000) the running ECE first drops under {COLD_THRESHOLD}",
            f"after {first('humaneval', DEFAULT)} labelled drafts on HumanEval and "
            f"{first('mtbench', DEFAULT)} on MT-Bench (trace order;",
            f"all orders: {orders('humaneval', DEFAULT)} and {orders('mtbench', DEFAULT)}), against "
            f"{first('humaneval', PLAIN)} and {first('mtbench', PLAIN)}",
            f"(orders: {orders('humaneval', PLAIN)} and {orders('mtbench', PLAIN)}) for the plain "
            "reference step (memory=0)."]

    out += ["", "## 4. Prior survival for a new request (each prompt's first step)", "",
            "Brier score of S_i against 'slots 0..i all accepted', and the error of the",
            "expected accepted length sum_i S_i (bias and mean absolute error, tokens).",
            "prior_survival = cumprod of the observed per-position acceptance rates (the model",
            "at the mean feature where a position has no labels); 'model at mean feature' =",
            "cumprod of sigmoid(w * mean_f_i + b_i), the previous prior_survival.", ""]
    rows = [[d, name, v["brier"], v["accepted_len_bias"], v["accepted_len_mae"], v["n_prompts"]]
            for d in DATASETS for name, v in priors[d].items()]
    out.append(md_table(["dataset", "prior", "Brier", "len bias", "len MAE", "prompts"], rows))
    return "\n".join(out)


if __name__ == "__main__":
    main()
