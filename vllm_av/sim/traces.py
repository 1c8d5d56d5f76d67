"""Labelled draft traces as per-position "tapes" that a simulated request replays.

Model. A trace records, per step s of one prompt, the generated length g_s,
the drafts d_s, the accepted count a_s and the features of every drafted
slot. Its output is a sequence of L tokens, each one of:

- an accepted draft (label 1): the draft at this output position, drafted
  from exactly the output prefix before it, was accepted;
- a correction (label 0): the draft here was the step's first rejection;
- a bonus (label -1, unknown): every draft of the step was accepted and the
  target sampled this token; nobody drafted at this position.

A simulated request at output position g drafts a fresh block. We couple it
to the trace: its draft at position g + i is accepted iff the trace's label
there is 1 (for a bonus position, a coin with the expected acceptance of the
last draft before it, drawn once per request instance). This is exact in
distribution wherever the trace has a draft at that position with the same
prefix: the drafter at g + i conditions on the output prefix, which the
simulated request shares with the trace as long as every earlier draft of its
block was accepted, and rejection sampling makes the emitted token (accepted
draft, correction or bonus) a sample of the target's next-token distribution
at that prefix, so we may identify it with the trace's token. The run
length

    run[g] = number of consecutive accepted labels starting at g

is then what any block starting at g gets: verifying a prefix of length a
accepts min(a, run[g]) drafts and emits one more token (correction or
bonus). A request that trims, lands mid-step and re-drafts from there sees
the labels of the trace's drafts at those positions, including ones that
were drafted in a different trace step. Because run[g] - counted until
the next 0 label - makes the furthest reachable landing point
min(g + run[g], g + K) + 1 non-decreasing in g, no policy can get ahead of
one that always verifies the accepted run (the oracle) in steps.

Approximations (documented in docs/simulator.md): features of drafts after a
rejection (censored in the trace, or drafted from a prefix the trace never
had) are read from the trace at the same output position; a bonus
position's feature is the last draft's feature before it; its acceptance is
a coin with that draft's expected acceptance sum_v min(p_v, q_v).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Label values on a tape.
ACCEPTED = 1
REJECTED = 0
BONUS = -1  # no draft in the trace at this position; decided by a coin


@dataclass
class PromptTape:
    """One prompt's output, position by position."""

    prompt_id: str
    labels: np.ndarray  # [L] int8: ACCEPTED / REJECTED / BONUS
    features: np.ndarray  # [L] float32: feature of the draft at this position
    bonus_accept: np.ndarray  # [L] float32: coin probability at BONUS positions, else 0

    @property
    def length(self) -> int:
        return int(self.labels.size)

    def instantiate(self, rng: np.random.Generator, pad: int):
        """A request instance: (run [L + pad] int32, features [L + pad] float32).

        Bonus coins are drawn here, once per instance; past the end of the
        output run is 0 and features are 0 (the request has finished).
        """
        L = self.length
        ok = self.labels == ACCEPTED
        coin = rng.random(L) < self.bonus_accept
        ok = np.where(self.labels == BONUS, coin, ok)
        ok = np.concatenate([ok, np.zeros(pad, dtype=bool)])  # [L + pad]
        idx = np.arange(L + pad)
        # run[g] = next_zero(g) - g, next_zero from a reversed running minimum.
        zero_at = np.where(ok, L + pad, idx)
        next_zero = np.minimum.accumulate(zero_at[::-1])[::-1]
        run = (next_zero - idx).astype(np.int32)
        feats = np.concatenate([self.features, np.zeros(pad, dtype=np.float32)])
        return run, feats


def tape_from_steps(prompt_id, n_drafted, n_accepted, n_emitted, features, exp_accept):
    """Build a tape from per-step arrays: [S] ints and [S, K] floats (rows by position)."""
    labels, feats, bonus = [], [], []
    for d, a, e, f, q in zip(n_drafted, n_accepted, n_emitted, features, exp_accept):
        d, a, e = int(d), int(a), int(e)
        n_acc = min(a, e)
        labels += [ACCEPTED] * n_acc
        feats += list(f[:n_acc])
        bonus += [0.0] * n_acc
        if e > a:  # the step ends in a correction or a bonus token
            if a < d:
                labels.append(REJECTED)
                feats.append(f[a])
                bonus.append(0.0)
            else:
                last = max(d - 1, 0)
                labels.append(BONUS)
                feats.append(f[last])
                bonus.append(float(np.clip(q[last], 0.0, 1.0)) if d > 0 else 0.0)
    return PromptTape(
        prompt_id,
        np.asarray(labels, dtype=np.int8),
        np.asarray(feats, dtype=np.float32),
        np.asarray(bonus, dtype=np.float32),
    )


@dataclass
class TraceSet:
    """The prompt pool: tapes in a fixed order, K of the recorded drafts."""

    name: str
    K: int
    tapes: list[PromptTape]

    @property
    def max_length(self) -> int:
        return max(t.length for t in self.tapes)

    @classmethod
    def from_npz(cls, path, feature: str = "pos_logit_q_max") -> "TraceSet":
        """Load `traces_<dataset>.npz` (see shared/data/traces/README.md)."""
        path = Path(path)
        d = np.load(path)
        K = int(d["pos_position"].max()) + 1
        # Row index of every (prompt, step, position); rows are stored in that order.
        key_p, key_s = d["pos_prompt_idx"], d["pos_step"]
        pos = d["pos_position"].astype(np.int64)
        tapes = []
        for p in dict.fromkeys(d["step_prompt_idx"].tolist()):  # stored order
            srow = np.flatnonzero(d["step_prompt_idx"] == p)
            srow = srow[np.argsort(d["step_step"][srow], kind="stable")]
            S = srow.size
            prow = np.flatnonzero(key_p == p)
            feats = np.zeros((S, K), dtype=np.float32)
            expa = np.zeros((S, K), dtype=np.float32)
            step_index = np.searchsorted(d["step_step"][srow], key_s[prow])
            feats[step_index, pos[prow]] = d[feature][prow]
            expa[step_index, pos[prow]] = d["pos_exp_accept"][prow]
            tapes.append(
                tape_from_steps(
                    str(d["step_prompt_id"][srow[0]]),
                    d["step_n_drafted"][srow],
                    d["step_n_accepted"][srow],
                    d["step_n_emitted"][srow],
                    feats,
                    expa,
                )
            )
        name = path.stem.removeprefix("traces_")
        return cls(name, K, tapes)

    @classmethod
    def synthetic(
        cls,
        num_prompts: int = 8,
        num_steps: int = 24,
        K: int = 7,
        slope: float = 1.0,
        intercept: float = 0.5,
        seed: int = 0,
    ) -> "TraceSet":
        """Random traces from a known acceptance model (for tests).

        Features f ~ N(2, 2); a draft is accepted with probability
        sigmoid(slope * f + intercept) given that the earlier ones were.
        """
        rng = np.random.default_rng(seed)
        tapes = []
        for p in range(num_prompts):
            f = rng.normal(2.0, 2.0, size=(num_steps, K)).astype(np.float32)
            prob = 1.0 / (1.0 + np.exp(-(slope * f + intercept)))
            acc = rng.random((num_steps, K)) < prob
            n_acc = np.where(acc.all(1), K, np.argmin(acc, axis=1))
            tapes.append(
                tape_from_steps(
                    f"synthetic/{p}", np.full(num_steps, K), n_acc, n_acc + 1, f, prob
                )
            )
        return cls("synthetic", K, tapes)


def load_traces(directory, datasets=("humaneval", "mtbench")) -> list[TraceSet]:
    """The real traces present in `directory` (missing datasets are skipped)."""
    out = []
    for ds in datasets:
        path = Path(directory) / f"traces_{ds}.npz"
        if path.exists():
            out.append(TraceSet.from_npz(path))
    return out


__all__ = ["PromptTape", "TraceSet", "load_traces", "tape_from_steps"]
