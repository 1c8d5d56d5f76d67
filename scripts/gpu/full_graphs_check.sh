#!/usr/bin/env bash
# Ours and plain V1 decoding served with cudagraph_mode FULL (one captured
# graph family for every batch shape, FA3 on SM90) instead of vLLM's
# FULL_AND_PIECEWISE default, under which any step whose requests do not all
# carry 1+K tokens (every depth-0 or trimmed step of ours) runs piecewise.
# Run detached after round.sh's sweep (same staging, same server settings).
set -uo pipefail
ROOT=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
cd "$ROOT"
source .gpu/tools/env.sh
export PYTHONPATH=/tmp/site_av:$ROOT:${PYTHONPATH:-}
RES=/tmp/results
ARGS="--max-model-len 4096 --max-num-seqs 256 --gpu-memory-utilization 0.12 --kv-cache-memory-bytes 6442450944"
ARGS="$ARGS --compilation-config '{\"cudagraph_mode\": \"FULL\"}'"
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/sweep.py run --run-name h200_full_graphs --results-root "$RES" \
  --target "$TARGET_MODEL" --draft "$DRAFT_MODEL" \
  --prompts .gpu/prompts/mtbench.jsonl,.gpu/prompts/humaneval.jsonl \
  --concurrency "${CONC:-1,16,64,256}" --output-len 256 --min-prompts 8 --warmup-prompts 8 \
  --health-timeout 600 --parallel-start --quiet-start none \
  --server-args "$ARGS" --arms "${ARMS:-ours,nospecv1}" >> "$RES/h200_full_graphs.log" 2>&1
echo "full graphs check exit $?" >> "$RES/job.log"
touch "$RES/DONE_FULL"
