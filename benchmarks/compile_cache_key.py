"""Whether two starts of an engine of ours share torch.compile's cache key.

vLLM 0.32 keys its compile cache by `VllmConfig.compute_hash`; our options
ride in the hashed `additional_config` with a fresh metrics directory per
server, which ConfigHashWithoutMetricsDirPatch leaves out of the hash. This
starts the tests' tiny pair with our AV and torch.compile on
(enforce_eager=False) twice, each in a fresh process, with the patch and
with it reverted, and reads the AOT cache keys vLLM logs:

    python benchmarks/compile_cache_key.py --out /tmp/key.json   # about 2 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, time, pathlib
sys.path.insert(0, {tests!r})
from tiny_models import build_tiny_models
m = build_tiny_models(pathlib.Path({models!r}))
if {revert}:
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm_av.vllm.config_patch import ConfigHashWithoutMetricsDirPatch
    from vllm_av.vllm.patching import revert_patch
    revert_patch(ConfigHashWithoutMetricsDirPatch)
from vllm import LLM
t = time.time()
LLM(model=str(m.target), dtype="float32", max_model_len=256, max_num_seqs=8,
    kv_cache_memory_bytes=64 << 20, enforce_eager=False,
    speculative_config={{"model": str(m.draft), "method": "draft_model",
                        "num_speculative_tokens": 3, "enable_adaptive_verification": True}})
print("STARTUP_S", round(time.time() - t, 1), flush=True)
"""
AOT = re.compile(r"\[(\w+)\] (?:saved AOT compiled function to|Directly load AOT compilation from path) "
                 r"\S*/torch_aot_compile/([0-9a-f]+)")


def start(models: str, revert: bool) -> dict:
    code = CHILD.format(tests=str(REPO / "tests" / "vllm"), models=models, revert=revert)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    log = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"engine start failed (rc {out.returncode}):\n{log[-3000:]}")
    startup = re.search(r"STARTUP_S ([0-9.]+)", log)
    return {"aot_keys": {name: key for name, key in AOT.findall(log)},
            "startup_s": float(startup.group(1)) if startup else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    models = tempfile.mkdtemp(prefix="vllm-av-tiny-")
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs"}
    for arm, revert in (("patched", False), ("reverted", True)):
        starts = [start(models, revert) for _ in range(2)]
        result[arm] = {"starts": starts,
                       "same_key": starts[0]["aot_keys"] == starts[1]["aot_keys"]}
        print(arm, json.dumps(result[arm]), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
