"""Summarise logs of tests/gpu/test_gpu_lossless.py (pytest -v -s) as JSON.

    python scripts/gpu/lossless_summary.py benchmarks/results/<round>/tests_gpu_lossless*.log \
        --machine "NVIDIA H100 80GB HBM3" --date 2026-12-07 --out benchmarks/results/<round>/summary.json

For each log: every distribution run the tests printed (label, dtype,
sample count, chi-square p-values, AV counters), the negative control's
runs apart (a deliberately lossy admission: its p-values must be tiny, and
they are kept out of `min_p`), each test's verdict in the order pytest ran
them, and pytest's closing line. A test whose verdict never appears was
running when the log was cut (the call's time limit); it is reported as
such, not as passed.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from collections import Counter
from pathlib import Path

# "GPU AV on <label> (dtype)", "GPU AV (dtype)", "GPU AV async (dtype)", and
# the negative control's "GPU lossy admission (dtype)" (no N, no counters);
# the first rounds' logs print no dtype.
RUN = re.compile(r"GPU (?P<kind>AV(?: on (?P<label>[^:\n]*?)| async)?|lossy admission)"
                 r"(?: \((?P<dtype>bfloat16|float32)\))?: (?:N=(?P<n>\d+) )?"
                 r"chi-square p-values (?P<p>\{[^}]*\})(?:; AV counters (?P<stats>\{.*?\}|None))?\n")
LOSSY = "lossy admission"
TOKEN = re.compile(r"^tests/\S+::(test_\S+)|\b(PASSED|FAILED|ERROR)\b", re.M)
CLOSING = re.compile(r"^=+ (.* in [0-9.]+s.*?) =+$", re.M)
CUT = "cut while running (the log ends before its verdict)"


def _literal(text: str):
    # AV counters print NaN as `nan`, which literal_eval does not read.
    return ast.literal_eval(re.sub(r"\bnan\b", "None", text))


def summarise(text: str) -> dict:
    runs, lossy = [], []
    for m in RUN.finditer(text):
        run = {"label": m["label"] or m["kind"], "dtype": m["dtype"],
               "n": int(m["n"]) if m["n"] else None, "p_values": _literal(m["p"]),
               "av_counters": _literal(m["stats"]) if m["stats"] else None}
        (lossy if m["kind"] == LOSSY else runs).append(run)
    verdicts: list[dict] = []
    for test, verdict in TOKEN.findall(text):
        if test:
            verdicts.append({"test": test, "verdict": CUT})
        elif verdicts and verdicts[-1]["verdict"] == CUT:
            verdicts[-1]["verdict"] = verdict
    closing = CLOSING.findall(text)
    return {"distribution_runs": runs, "negative_control_runs": lossy, "verdicts": verdicts,
            "pytest_summary": closing[-1] if closing else None,
            "min_p": min((min(r["p_values"].values()) for r in runs), default=None)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--machine", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("--alpha", type=float, default=1e-5, help="each check's threshold in the tests")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    runs = {}
    for path in args.logs:
        runs[Path(path).name] = summarise(Path(path).read_text(errors="replace"))
    out = {"machine": args.machine, "date": args.date, "alpha_per_check": args.alpha, "runs": runs}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for name, run in runs.items():
        counts = dict(Counter(v["verdict"] for v in run["verdicts"]))
        print(f"{name}: {counts}, smallest p {run['min_p']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
