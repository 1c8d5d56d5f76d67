#!/usr/bin/env bash
# One GPU round, run on the lent machine after the kit has staged vLLM 0.32
# and the bf16 model pair (docs/gpu.md has the whole sequence).
#
#   bash scripts/gpu/round.sh A   # the draft-model sweep
#   bash scripts/gpu/round.sh B   # the ngram sweep, MRV2 smoke; step breakdown of ours
#                                 # and no speculation, tests/gpu
#
# Each call works in two lanes, one per GPU when the machine has two (else
# one after the other on the one GPU): every lane is its own sweep run
# folder, so no two benches share a GPU. Servers of one lane start together
# (benchmarks/sweep.py --parallel-start) and each gets a share of the GPU.
# Results are packed into $OUT every minute, so a call stopped at its time
# limit still brings back what it finished.
set -uo pipefail
PART=${1:-A}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source .gpu/tools/env.sh
python3 scripts/gpu/register_plugin.py /tmp/site_av >/dev/null
export PYTHONPATH=/tmp/site_av:$ROOT:$PYTHONPATH
RES=/tmp/results; mkdir -p "$RES"
LIMIT=${LANE_LIMIT_S:-530}   # each lane's own limit, inside the call's 600 s
NGPU=$(nvidia-smi -L | wc -l)
log() { echo "[round $PART $(date -u +%T)] $*"; }
log "$NGPU GPU(s); lanes stop after $LIMIT s"

pack() { tar czf "$OUT/results_$PART.tgz.tmp" -C "$RES" . 2>/dev/null && mv "$OUT/results_$PART.tgz.tmp" "$OUT/results_$PART.tgz"; }
( while sleep 60; do pack; done ) &
PACKER=$!

# 256 sequences: vLLM 0.32's V2 warm-up with a draft model and K=7 builds a
# batch of min(max_num_seqs, 8192 // 9) requests whose drafter prefill
# (9100 tokens at the H200 default of 1024 sequences) falls outside the
# compiled range and kills start-up; 256 keeps it inside and is the largest
# concurrency the sweep uses.
SERVER_ARGS="--max-model-len 4096 --max-num-seqs 256 --gpu-memory-utilization 0.2 --kv-cache-memory-bytes 12884901888"
sweep() {  # sweep <gpu> <run name> <arms> [extra sweep args]
  local gpu=$1 run=$2 arms=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu VLLM_AV_COST_TABLE_OUT=$RES/cost_table_${run}.json \
  timeout -s INT "$LIMIT" python3 benchmarks/sweep.py run --run-name "$run" --results-root "$RES" \
    --target "$TARGET_MODEL" --draft "$DRAFT_MODEL" \
    --prompts .gpu/prompts/mtbench.jsonl,.gpu/prompts/humaneval.jsonl \
    --concurrency "${CONC:-1,64,256}" --output-len "${OUTPUT_LEN:-192}" \
    --min-prompts "${MIN_PROMPTS:-8}" --warmup-prompts 8 --health-timeout 400 --parallel-start \
    --server-args "$SERVER_ARGS" --arms "$arms" "$@" > "$RES/$run.log" 2>&1
  log "sweep $run exit $?"; tail -25 "$RES/$run.log"
}

if [[ "$PART" == A ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  # Lane 0: ours with no speculation and K=3; lane 1: vLLM's AV with no
  # speculation and K=7. Both lanes carry no speculation, which ties the
  # two GPUs' numbers together. Three arms per lane: on 2026-11-29 a
  # server took 130-230 s to start and each bench client ~35 s, so more
  # do not fit in one call (K=1, 5 and kNv1 arms: ARMS_G0/ARMS_G1 of a
  # later call).
  sweep 0 h200_g0 "${ARMS_G0:-ours,nospec,k3}" &
  P0=$!
  if [[ $NGPU -gt 1 ]]; then sweep 1 h200_g1 "${ARMS_G1:-vllm_av,nospec,k7}"; fi
  wait $P0
else
  # No speculation is the same server in both families: the ngram report
  # takes it from part A (lane 0).
  ( sweep 0 h200_ngram "${ARMS_NGRAM:-ngram_ours,ngram_k3}"
    if [[ -f scripts/gpu/smoke_mrv2.py ]]; then
      log "MRV2 smoke"
      CUDA_VISIBLE_DEVICES=0 timeout 150 python3 scripts/gpu/smoke_mrv2.py --impl ours \
        > "$RES/smoke_mrv2.log" 2>&1
      log "MRV2 smoke exit $?"; grep -a "RESULT\|Error\|error" "$RES/smoke_mrv2.log" | tail -8
    fi ) &
  P0=$!
  G=1
  if [[ $NGPU -lt 2 ]]; then G=0; wait $P0; fi   # one GPU: one lane after the other
  (
    export CUDA_VISIBLE_DEVICES=$G
    # Ours against no speculation on one GPU, one after the other (each
    # breakdown took 130-160 s on 2026-11-29), then the engine tests. The
    # GPU distribution test (287 s then) only with TESTS_LOSSLESS=1.
    for arm in ${BREAKDOWN_ARMS:-ours nospec}; do
      log "step breakdown $arm"
      timeout 200 python3 scripts/gpu/step_breakdown.py --arm "$arm" --out "$RES/breakdown_$arm.json" \
        > "$RES/breakdown_$arm.log" 2>&1
      log "breakdown $arm exit $?"; grep -a "^\[$arm\]" "$RES/breakdown_$arm.log"; tail -3 "$RES/breakdown_$arm.log"
    done
    log "tests/gpu: engines"
    timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -v -s tests/gpu/test_gpu_av.py > "$RES/tests_gpu_av.log" 2>&1
    log "tests/gpu av exit $?"; grep -a "PASS\|FAIL\|exact\|passed\|failed" "$RES/tests_gpu_av.log" | tail -8
    if [[ "${TESTS_LOSSLESS:-0}" == 1 ]]; then
      log "tests/gpu: distribution"
      timeout 300 python3 -m pytest -v -s tests/gpu/test_gpu_lossless.py > "$RES/tests_gpu_lossless.log" 2>&1
      log "tests/gpu lossless exit $?"; grep -a "PASS\|FAIL\|p-values\|passed\|failed" "$RES/tests_gpu_lossless.log" | tail -8
    fi
  )
  wait $P0
fi
for d in "$RES"/h200_*/; do
  [[ -d "$d" ]] && python3 benchmarks/sweep.py report "$d" --no-plots > "$d/report_stdout.md" 2>&1
done
kill $PACKER 2>/dev/null
pack
log "done: $(ls -la "$OUT")"
