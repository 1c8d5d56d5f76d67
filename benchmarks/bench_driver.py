"""`vllm bench serve`, many times in one process.

Starting the `vllm bench serve` client costs 30-35 s of imports on the GPU
machine, longer than most benchmark runs of a sweep. This driver imports
vLLM's benchmark once and then runs one benchmark per request, with the
same arguments and the same code as the command line.

Protocol (used by benchmarks/sweep.py): one JSON line per request on stdin,
{"argv": [arguments after `vllm bench serve`], "log": path}; the benchmark's
output goes to that log; the driver answers {"rc": exit status, "error":
text or null} on one line of its stdout. Its own output goes to --log.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback


def _redirect(fd_target: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd_target, 1)
    os.dup2(fd_target, 2)


def _run_one(parser_factory, bench_main, argv: list[str]) -> tuple[int, str | None]:
    try:
        bench_main(parser_factory().parse_args(argv))
        return 0, None
    except SystemExit as e:  # argparse errors, or the benchmark giving up
        return (e.code if isinstance(e.code, int) else 1), f"exit {e.code}"
    except Exception as e:  # noqa: BLE001 - reported to the sweep, the driver lives on
        traceback.print_exc()
        return 1, f"{type(e).__name__}: {e}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", required=True, help="where the driver's own output goes")
    opts = ap.parse_args()
    # Answers go to the original stdout; everything else (vLLM's logging,
    # the benchmark's prints) to a log, so it cannot garble the protocol.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    own_log = open(opts.log, "ab", buffering=0)
    _redirect(own_log.fileno())

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parser_factory():
        p = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(p)
        return p

    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        with open(req["log"], "ab", buffering=0) as log:
            log.write(f"\n$ vllm bench serve {' '.join(req['argv'])}\n".encode())
            _redirect(log.fileno())
            try:
                rc, err = _run_one(parser_factory, bench_main, req["argv"])
            finally:
                _redirect(own_log.fileno())
        answers.write(json.dumps({"rc": rc, "error": err}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
