#!/usr/bin/env bash
# The main job on a CPU machine: install, prepare the real model pair and
# prompts, then serve Qwen2.5-Coder 1.5B with the 0.5B draft three ways
# (`ours`: draft_model K=7 with adaptive verification; `nospec`; `k3`:
# draft_model fixed K=3), send real HumanEval / MT-Bench prompts at a few
# concurrencies, print a summary table and write the JSON summary.
#
# Usage: scripts/main_job.sh [python -m vllm_av.demo args...]
#   e.g. --arms ours,k3 --concurrency 1,2,4 --max-tokens 128 --num-prompts 8
#        --out FILE (default benchmarks/results/main_job_<date>.json)
#   VENV=DIR   the venv (default: .venv in the checkout)
#
# Steps, each skipped when already done:
#  1. scripts/install_cpu.sh, unless the venv's install stamp matches the
#     current inputs (the stamp scripts/test.sh computes);
#  2. python -m vllm_av.models (cached in $VLLM_AV_CACHE or ~/.cache/vllm-av);
#  3. python -m vllm_av.demo: one `vllm serve` per arm, stopped with its
#     whole process group before the next starts.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
export VENV
cd "$ROOT"
START=$SECONDS
say() { printf '[main_job %5ds] %s\n' "$((SECONDS - START))" "$*"; }

say "1/3 install ($VENV)"
STAMP="$VENV/.vllm_av_install_stamp"
if [[ -x "$VENV/bin/python" && -f "$STAMP" \
      && "$(cat "$STAMP")" == "$(scripts/test.sh --print-install-stamp)" ]]; then
  say "  venv is current, skipping scripts/install_cpu.sh"
else
  scripts/install_cpu.sh
fi

say "2/3 models and prompts (python -m vllm_av.models)"
"$VENV/bin/python" -m vllm_av.models

say "3/3 serve and measure (python -m vllm_av.demo $*)"
"$VENV/bin/python" -m vllm_av.demo "$@"
say "main job done in $((SECONDS - START)) s"
