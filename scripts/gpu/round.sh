#!/usr/bin/env bash
# One GPU round on the lent H200, run there after the kit has staged vLLM
# 0.32 and the bf16 model pair (docs/gpu.md has the whole sequence).
#
#   bash scripts/gpu/round.sh A   # micro-benchmarks, sweep part A (ours, nospec, vLLM's AV)
#   bash scripts/gpu/round.sh B   # sweep part B (K=3, K=7), tests/gpu
#
# Everything worth keeping lands in $OUT (at most 8 files come back): the
# micro-benchmark JSON, the test log and one tarball of the sweep folder.
set -uo pipefail
PART=${1:-A}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source .gpu/tools/env.sh
# vllm-av itself: the checkout on PYTHONPATH plus its plugin entry point.
python3 scripts/gpu/register_plugin.py /tmp/site_av
export PYTHONPATH=/tmp/site_av:$ROOT:$PYTHONPATH
export VLLM_AV_COST_TABLE_OUT=/tmp/sweep/cost_table_ours.json
mkdir -p /tmp/sweep
log() { echo "[round $PART $(date -u +%T)] $*"; }

RUN=${RUN_NAME:-h200}
SWEEP=(python3 benchmarks/sweep.py run --run-name "$RUN" --results-root /tmp/sweep
       --target "$TARGET_MODEL" --draft "$DRAFT_MODEL"
       --prompts .gpu/prompts/mtbench.jsonl,.gpu/prompts/humaneval.jsonl
       --concurrency "${CONC:-1,64,256}" --output-len "${OUTPUT_LEN:-192}"
       --warmup-prompts 16 --health-timeout 400
       --server-args "--max-model-len 4096 --gpu-memory-utilization 0.85 ${EXTRA_SERVER_ARGS:-}")

if [[ "$PART" == A ]]; then
  nvidia-smi -L
  log "micro-benchmarks"
  python3 benchmarks/microbench.py --iters 500 --out "$OUT/microbench_h200.json" | tail -5
  log "sweep part A"
  "${SWEEP[@]}" --arms "${ARMS_A:-ours,nospec,vllm_av}"
else
  log "sweep part B"
  "${SWEEP[@]}" --arms "${ARMS_B:-k3,k7}"
  log "tests/gpu"
  timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -s tests/gpu 2>&1 | tee "$OUT/tests_gpu.log" | tail -15
fi
python3 benchmarks/sweep.py report "/tmp/sweep/$RUN" > "/tmp/sweep/$RUN/report_stdout.md" 2>&1 || true
tar czf "$OUT/sweep_h200_$PART.tgz" -C /tmp/sweep .
log "done: $(ls "$OUT")"
