"""A random-weight bf16 pair with the real pair's shapes, for host-cost work.

Host costs per step (launches, input preparation, bookkeeping) depend on
the models' shapes, not on their weights, and the real pair's weights take
26 transfers and a conversion to reach a GPU machine (scripts/gpu/round.sh).
This builds Qwen2.5-Coder-1.5B's architecture from the target's config and
0.5B's (hidden 896, 24 layers, 14 heads of 64, 2 KV heads) beside it, with
random weights, and copies the tokenizer files into both:

    python3 scripts/gpu/random_pair.py --hf .gpu/randcfg/qwen15 --out /tmp/rand

Tokens and acceptance from these models mean nothing: use them for
per-step host timings and profiles of plain decoding only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

# Qwen2.5-Coder-0.5B-Instruct's shapes (as the kit's conversion writes them:
# an untied lm_head).
DRAFT_SHAPES = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                "num_attention_heads": 14, "num_key_value_heads": 2, "max_window_layers": 24,
                "tie_word_embeddings": False}


def build(config_dir: Path, out: Path, shapes: dict | None) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    cfg = json.loads((config_dir / "config.json").read_text())
    if shapes:
        cfg.update(shapes)
        cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in config_dir.iterdir():
        if f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"[random-pair] {out.name}: {n / 1e6:.0f}M parameters, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True,
                    help="the target's config.json and tokenizer files (the kit's hf/qwen15)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    src, out = Path(args.hf), Path(args.out)
    build(src, out / "qwen15", None)
    build(src, out / "qwen05", DRAFT_SHAPES)


if __name__ == "__main__":
    main()
