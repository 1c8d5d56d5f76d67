"""Command line: prepare the model pair and the prompt sets in the cache.

    python -m vllm_av.models                  # models, then prompts
    python -m vllm_av.models --models-only    # fetch + convert the two checkpoints
    python -m vllm_av.models --prompts-only   # HumanEval + MT-Bench jsonl (needs the target)
    python -m vllm_av.models --cache-dir DIR  # instead of $VLLM_AV_CACHE or ~/.cache/vllm-av
    python -m vllm_av.models --force          # redo even if the markers say done

Needs a CPU python with torch, transformers, gguf, accelerate, safetensors.
Exit status 1 with a one-line message when a part package is missing or
the joined file does not verify.
"""

from __future__ import annotations

import argparse
import sys
import time

from vllm_av.models.parts import PartError
from vllm_av.models.prepare import log_line, prepare_models
from vllm_av.models.prompts import prepare_prompts
from vllm_av.models.specs import cache_root


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_av.models", description=__doc__.split("\n")[0])
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--models-only", action="store_true", help="skip the prompt sets")
    only.add_argument("--prompts-only", action="store_true", help="skip the models")
    ap.add_argument("--cache-dir", help="cache root (default: $VLLM_AV_CACHE or ~/.cache/vllm-av)")
    ap.add_argument("--force", action="store_true", help="redo steps that are marked done")
    args = ap.parse_args(argv)

    log_line(f"cache root {cache_root(args.cache_dir)}")
    t0 = time.monotonic()
    try:
        if not args.prompts_only:
            for role, path in prepare_models(args.cache_dir, force=args.force).items():
                log_line(f"{role} checkpoint: {path}")
        if not args.models_only:
            for name, path in prepare_prompts(args.cache_dir, force=args.force).items():
                log_line(f"{name} prompts: {path}")
    except (PartError, FileNotFoundError) as e:
        print(f"[vllm-av models] error: {e}", file=sys.stderr)
        return 1
    log_line(f"all done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
