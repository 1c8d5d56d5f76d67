#!/usr/bin/env bash
# One GPU round, run on the lent machine after the kit has staged vLLM 0.32
# and the bf16 model pair (docs/gpu.md has the whole sequence).
#
#   bash scripts/gpu/round.sh start       # the whole round, detached (returns at once)
#   bash scripts/gpu/round.sh poll 300    # wait up to 300 s, show progress, copy results to $OUT
#   bash scripts/gpu/round.sh focus       # the short round, detached (see `focus` below)
#   GREEDY=1 bash scripts/gpu/round.sh focus  # ... with a greedy pass after each temperature pass
#   bash scripts/gpu/round.sh full        # every arm of the sweep, in two parts (see `full` below)
#   SIDE_BY_SIDE=a,b bash scripts/gpu/round.sh side  # after a round: scripts/gpu/side_by_side.py alone
#   SIDE_BY_SIDE=a,b bash scripts/gpu/round.sh side-here  # the same in this call (no polls), results.tgz in $OUT
#     (with RANDOM_PAIR=1 it needs no model staging: the shortest round)
#
# The round runs in its own process session, so it outlives the device
# call that started it and no call's 10-minute limit cuts a sweep in two:
# back-to-back `poll` calls keep the machine and bring results back as they
# land (results.tgz in $OUT, the whole of /tmp/results each time).
#
# What it does (two GPUs: two lanes side by side; one GPU: one after the other):
#  GPU 0: the serving sweep (benchmarks/sweep.py) of ours (synchronous, and
#     with --async-scheduling: depth chosen when scheduled), no speculation
#     (V2, V1, and V1 with synchronous scheduling as ours serves), K=3,
#     the ngram arms and vLLM's AV: every server starts
#     before the first bench (vLLM's AV alone first, on a quiet GPU, for its
#     start-up cost profile; ours self-corrects its profile from timed
#     steps), then each arm is benched in turn; tests/gpu/test_gpu_server.py
#     (256 requests with aborts, /metrics) runs against ours' live server;
#     then ours again with VLLM_AV_VARLEN_FULL_GRAPHS=0 (h200_ours_piecewise).
#  GPU 1: tests/gpu/test_gpu_lossless.py (the T=1 distribution under graphs),
#     tests/gpu/test_gpu_av.py (greedy outputs, eager and graphs), the
#     step breakdown of K=3 on V1 and ours, more fixed-K arms (h200_sweep_b: compare them
#     within their own lane), and scripts/gpu/smoke_mrv2.py --impl ours.
set -uo pipefail
MODE=${1:-start}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/out}
RES=/tmp/results
JOBLOG=$RES/job.log

pack() {  # a compacted copy: uncompacted sweep results outgrow what a call brings back
  mkdir -p "$OUT"
  rm -rf /tmp/pack && cp -r "$RES" /tmp/pack
  for d in /tmp/pack/*/; do python3 benchmarks/sweep.py compact "$d" > /dev/null 2>&1; done
  tar czf "$OUT/results.tgz.tmp" -C /tmp/pack . 2>/dev/null && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"
}

case "$MODE" in
  start|focus|full|side)
    mkdir -p "$RES"
    # The device tool refreshes the checkout between calls: run a copy.
    cp "$0" /tmp/round_job_$MODE.sh
    if [[ $MODE == side ]]; then
      # After a round's DONE on the same machine: its log goes on.
      rm -f "$RES/DONE"; echo "[side] $(date -u +%T)" >> "$JOBLOG"
    else
      : > "$JOBLOG"
    fi
    JOB_KIND=$MODE setsid nohup bash /tmp/round_job_$MODE.sh job "$ROOT" >> "$JOBLOG" 2>&1 < /dev/null &
    sleep 5
    cat "$JOBLOG"
    exit 0 ;;
  side-here)
    # In the foreground: a call that ends with the run leaves no machine to
    # lose between polls; what it wrote is packed even when it fails.
    mkdir -p "$RES"
    JOB_KIND=side bash "$0" job "$ROOT" >> "$JOBLOG" 2>&1 < /dev/null
    rc=$?
    tail -30 "$JOBLOG"
    pack
    exit $rc ;;
  poll|job) ;;
  *) echo "usage: round.sh start | focus | full | side | side-here | poll [seconds]" >&2; exit 2 ;;
esac

if [[ "$MODE" == poll ]]; then
  WAIT=${2:-300}
  t0=$(date +%s)
  while [[ ! -f $RES/DONE ]] && (( $(date +%s) - t0 < WAIT )); do sleep 10; done
  echo "== job.log (last 40 lines)"; tail -40 "$JOBLOG"
  sbs=$(ls -t "$RES"/side_by_side*.log 2>/dev/null | head -1)  # the latest run's
  [[ -n $sbs ]] && { echo "== ${sbs##*/}"; grep -a "^\[C=\|^\[cprofile\|^\[kernels\|^    [+-][0-9]\|started in\|Error" "$sbs" | cut -c1-220 | tail -60; }
  for f in "$RES"/h200_*.log; do [[ -f $f ]] && { echo "== $f"; grep -a "^\[sweep" "$f" | tail -25; }; done
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  [[ -f $RES/DONE ]] && echo "ROUND DONE"
  pack
  exit 0
fi

# ---- job (detached)
ROOT=${2:-$ROOT}
cd "$ROOT"
source .gpu/tools/env.sh
python3 scripts/gpu/register_plugin.py /tmp/site_av >/dev/null
export PYTHONPATH=/tmp/site_av:$ROOT:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
log() { echo "[round $(date -u +%T)] $*"; }
# RANDOM_PAIR=1: random weights of the real pair's shapes stand in for the
# staged models (scripts/gpu/random_pair.py, from the tokenizer and config
# carried in .gpu/randcfg): rounds about host costs need no model staging.
# Their tokens and acceptance mean nothing.
if [[ -n ${RANDOM_PAIR:-} ]]; then
  python3 scripts/gpu/random_pair.py --hf .gpu/randcfg/qwen15 --out /tmp/rand
  export TARGET_MODEL=/tmp/rand/qwen15 DRAFT_MODEL=/tmp/rand/qwen05
fi
NGPU=$(nvidia-smi -L | wc -l)
log "$NGPU GPU(s)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

# 256 sequences: vLLM 0.32's V2 warm-up with a draft model and K=7 builds a
# batch of min(max_num_seqs, 8192 // 9) requests whose drafter prefill
# (9100 tokens at the H200 default of 1024 sequences) falls outside the
# compiled range and kills start-up; 256 keeps it inside and is the largest
# concurrency the sweep uses. 6 GiB of KV cache per server holds 256
# requests of the sweep (target + draft layers) and lets nine servers
# share one H200 (about 10 GiB each in use).
SERVER_ARGS="--max-model-len 4096 --max-num-seqs 256 --gpu-memory-utilization 0.12 --kv-cache-memory-bytes 6442450944"
RUN=${RUN_NAME:-h200_sweep}
GPU=0
sweep() {  # sweep <arms> [extra sweep args]; RUN and GPU pick the folder and the GPU
  local arms=$1; shift
  CUDA_VISIBLE_DEVICES=$GPU VLLM_AV_COST_TABLE_OUT=$RES/cost_table_${RUN}.json \
  python3 benchmarks/sweep.py run --run-name "$RUN" --results-root "$RES" \
    --target "$TARGET_MODEL" --draft "$DRAFT_MODEL" \
    --prompts .gpu/prompts/mtbench.jsonl,.gpu/prompts/humaneval.jsonl \
    --concurrency "${CONC:-1,16,32,64,128,256}" --output-len "${OUTPUT_LEN:-256}" \
    --min-prompts "${MIN_PROMPTS:-8}" --waves "${WAVES:-2}" --warmup-prompts 8 --health-timeout 600 --parallel-start \
    --server-args "$SERVER_ARGS" --arms "$arms" ${GREEDY:+--greedy} ${INTERLEAVE:+--interleave} ${SHARED_TABLE:+--shared-cost-table} "$@" >> "$RES/$RUN.log" 2>&1
  log "sweep $RUN ($arms) on GPU $GPU exit $?"
  python3 benchmarks/sweep.py report "$RES/$RUN" --no-plots > "$RES/$RUN.report.md" 2>&1
}

av_tests() {  # on $CUDA_VISIBLE_DEVICES; AV_TESTS: a pytest -k selection
  log "tests/gpu/test_gpu_av.py ${AV_TESTS:+(-k $AV_TESTS)}"
  timeout 1500 python3 -m pytest -v -s tests/gpu/test_gpu_av.py ${AV_TESTS:+-k "$AV_TESTS"} > "$RES/tests_gpu_av.log" 2>&1
  log "tests/gpu av exit $?"; grep -a "exact\|passed\|failed" "$RES/tests_gpu_av.log" | tail -8
  # The fused estimator kernels against their torch operations (seconds).
  timeout 300 python3 -m pytest -v -s tests/gpu/test_gpu_fused.py > "$RES/tests_gpu_fused.log" 2>&1
  log "tests/gpu fused exit $?"
  # No spec-decode kernel of ours compiled while serving (tiny pair, with the
  # served-kernel warm-up and without it; about 150 s).
  timeout 400 python3 -m pytest -v -s tests/gpu/test_gpu_served_warmup.py > "$RES/tests_gpu_served_warmup.log" 2>&1
  log "tests/gpu served warm-up exit $?"
  # Host time and waits of those kernels and the verify layout (seconds).
  timeout 300 python3 benchmarks/mrv2_host_costs.py --out "$RES/mrv2_host_costs_h200.json" \
    > "$RES/mrv2_host_costs.log" 2>&1
  log "mrv2_host_costs exit $?"
}

lossless_test() {  # on $CUDA_VISIBLE_DEVICES; LOSSLESS_TESTS: a pytest -k selection
  log "tests/gpu/test_gpu_lossless.py (T=1 distribution under CUDA graphs: trimmed steps, async scheduling, MRV2) ${LOSSLESS_TESTS:+(-k $LOSSLESS_TESTS)}"
  timeout 900 python3 -m pytest -v -s tests/gpu/test_gpu_lossless.py ${LOSSLESS_TESTS:+-k "$LOSSLESS_TESTS"} \
    > "$RES/tests_gpu_lossless.log" 2>&1
  log "tests/gpu lossless exit $?"; grep -a "p-values\|passed\|failed" "$RES/tests_gpu_lossless.log" | tail -6
  python3 scripts/gpu/lossless_summary.py "$RES/tests_gpu_lossless.log" --date "$(date -u +%F)" \
    --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
    --out "$RES/tests_gpu_lossless.json" || log "lossless_summary.py failed"
}

engine_tests() {  # engine_tests <gpu>
  export CUDA_VISIBLE_DEVICES=$1
  av_tests
  lossless_test
}

# Per-phase step times (scripts/gpu/step_breakdown.py) and a torch.profiler
# op table of one batch at the first concurrency: an arm named X_async is
# arm X served with async scheduling.
breakdown() {  # breakdown <gpu>
  export CUDA_VISIBLE_DEVICES=$1
  local arm name extra
  mkdir -p /tmp/traces
  for name in ${BREAKDOWN_ARMS:-k3v1 ours}; do
    arm=$name; extra=()
    if [[ $arm == *_async ]]; then arm=${arm%_async}; extra=(--async-scheduling); fi
    log "step breakdown $name"
    timeout 400 python3 scripts/gpu/step_breakdown.py --arm "$arm" "${extra[@]}" \
      --concurrency "${BREAKDOWN_CONC:-16,1,64}" --torch-profile "$RES/profile_$name.txt" \
      ${BREAKDOWN_TRACE:+--trace "/tmp/traces/trace_$name.json.gz"} \
      --out "$RES/breakdown_$name.json" > "$RES/breakdown_$name.log" 2>&1
    log "breakdown $name exit $?"; grep -a "^\[$arm\]" "$RES/breakdown_$name.log" | tail -5
    # The timeline itself stays on the machine (tens of MB); what the host
    # did while the GPU waited comes back.
    if [[ -f /tmp/traces/trace_$name.json.gz ]]; then
      python3 scripts/gpu/trace_gaps.py "/tmp/traces/trace_$name.json.gz" \
        --out "$RES/gaps_$name.json" > "$RES/gaps_$name.txt" 2>&1
      head -12 "$RES/gaps_$name.txt"
    fi
  done
}

# Engines of several arms alive at once, batches alternated between them
# (scripts/gpu/side_by_side.py): paired throughput ratios and each engine's
# host time per step by phase. SIDE_BY_SIDE: the arms (ratios over the
# first), SIDE_BY_SIDE_CONC: the concurrencies, SIDE_BY_SIDE_ARGS: more
# arguments (--gpu-spans: each step's GPU span from CUDA events),
# SIDE_BY_SIDE_TIMEOUT: its limit in seconds (default 1200; six engines
# start in about 10 minutes), SIDE_BY_SIDE_NAME: its files' name (default
# side_by_side; a second run on the same machine keeps the first's).
side_by_side() {
  [[ -z ${SIDE_BY_SIDE:-} ]] && return 0
  local name=${SIDE_BY_SIDE_NAME:-side_by_side}
  log "side by side: $SIDE_BY_SIDE ($name)"
  # SIDE_BY_SIDE_TABLE: a cost table for the ours arms (no start-up profile).
  env ${SIDE_BY_SIDE_TABLE:+VLLM_AV_COST_TABLE=$SIDE_BY_SIDE_TABLE} \
    timeout "${SIDE_BY_SIDE_TIMEOUT:-1200}" python3 scripts/gpu/side_by_side.py --arms "$SIDE_BY_SIDE" \
    --concurrency "${SIDE_BY_SIDE_CONC:-1,16,32,64,128,256}" --repeats "${SIDE_BY_SIDE_REPEATS:-5}" \
    ${SIDE_BY_SIDE_ARGS:-} --out "$RES/$name.json" > "$RES/$name.log" 2>&1
  log "side by side exit $?"; grep -a "^\[C=[0-9]*\] " "$RES/$name.log" | tail -24
}

mrv2_smoke() {  # mrv2_smoke <gpu>
  export CUDA_VISIBLE_DEVICES=$1
  log "MRV2 smoke (ours)"
  timeout 300 python3 scripts/gpu/smoke_mrv2.py --impl ours > "$RES/smoke_mrv2.log" 2>&1
  log "MRV2 smoke exit $?"; grep -a "RESULT\|Error" "$RES/smoke_mrv2.log" | tail -6
}

# The main sweep (QUIET: vLLM's AV started alone first, its start-up
# profile on a quiet GPU), tests/gpu/test_gpu_server.py against the live
# server of each arm of ours.
main_sweep() {
  local arms=${ARMS:-ours,ours_async,nospec,nospecv1,nospecv1sync,k3,ngram_ours,ngram_k3,vllm_av}
  # The engine test runs against every arm of ours (names holding "ours").
  local ours_arms
  ours_arms=${AFTER_ARMS:-$(echo "$arms" | tr , '\n' | grep ours | paste -sd, -)}
  sweep "$arms" \
    --quiet-start "${QUIET-vllm_av}" \
    --after-arm-cmd "python3 -m pytest -v -s tests/gpu/test_gpu_server.py" \
    --after-arm-arms "${ours_arms:-none}"
}
# Ours with the FULL graphs for any draft length switched off: what they bring.
piecewise_sweep() {
  VLLM_AV_VARLEN_FULL_GRAPHS=0 RUN=h200_ours_piecewise sweep ours --quiet-start none
}
# More fixed-K arms, in their own folder.
more_arms() {
  RUN=h200_sweep_b sweep "${ARMS2:-k1,k5,k7,ngram_k7}" --quiet-start none
}

if [[ "${JOB_KIND:-start}" == side ]]; then
  # The side-by-side run alone (SIDE_BY_SIDE and its options), on GPU 0.
  export CUDA_VISIBLE_DEVICES=0
  side_by_side
  log "done"
  touch "$RES/DONE"
  exit 0
fi
if [[ "${JOB_KIND:-start}" == focus && $NGPU -eq 1 ]]; then
  # The short round on one GPU, one thing at a time, correctness first:
  # LOSSLESS=1 the distribution tests (LOSSLESS_TESTS), then SIDE_BY_SIDE,
  # whose long run can then only cut itself short, then the sweep of
  # ARMS side by side (the engine test against AFTER_ARMS' live servers,
  # default every arm of ours; INTERLEAVE=1 benches each concurrency over
  # all arms in turn; SHARED_TABLE=1 starts the first ours arm alone and
  # gives its quiet start-up cost table to the other ours arms; QUIET=ours
  # starts every ours server alone), then AV_TESTS (greedy), if set.
  export CUDA_VISIBLE_DEVICES=0
  # BREAKDOWN_FIRST / BREAKDOWN_AFTER: step breakdowns of these arms
  # before / after the rest (BREAKDOWN_CONC, default 64,256), each arm's
  # engine alone on the GPU.
  breakdowns_of() {
    [[ -z $1 ]] && return 0
    BREAKDOWN_CONC=${BREAKDOWN_CONC:-64,256} BREAKDOWN_TRACE= BREAKDOWN_ARMS=$1 breakdown 0
  }
  breakdowns_of "${BREAKDOWN_FIRST:-}"
  [[ -n ${LOSSLESS:-} ]] && lossless_test
  side_by_side
  if [[ ${ARMS:-} != none ]]; then  # ARMS=none: no sweep
    OUTPUT_LEN=${OUTPUT_LEN:-512} RUN=${RUN_NAME:-h200_focus} \
      ARMS=${ARMS:-ours_served,nospec} QUIET=${QUIET:-none} main_sweep
  fi
  [[ -n ${AV_TESTS:-} ]] && av_tests
  # LOSSLESS_AFTER: more distribution tests (a pytest -k selection) last.
  if [[ -n ${LOSSLESS_AFTER:-} ]]; then
    cp "$RES/tests_gpu_lossless.log" "$RES/tests_gpu_lossless_first.log" 2>/dev/null
    cp "$RES/tests_gpu_lossless.json" "$RES/tests_gpu_lossless_first.json" 2>/dev/null
    LOSSLESS_TESTS=$LOSSLESS_AFTER lossless_test
  fi
  breakdowns_of "${BREAKDOWN_AFTER:-}"
  log "done"
  touch "$RES/DONE"
  exit 0
fi
if [[ "${JOB_KIND:-start}" == focus ]]; then
  # The short round on two GPUs, about 20 minutes after staging.
  # GPU 0: ours on Model Runner V2 with adaptive drafting depth (ours_v2)
  # against no speculation on V2 (vLLM's default runner) and ours on V1
  # against no speculation on V1, the sweep's settings (512-token outputs,
  # temperature 1; ARMS= and OUTPUT_LEN= override), with the engine test
  # against each of ours' live servers (256 requests with aborts).
  # GPU 1: the greedy tests of ours on V2 (depth K; depth forced to
  # alternate 0, K; adaptive depth as served), of the V1 options
  # skip_draft_layer_metadata (with same-round controls) and
  # drafter_catch_up (the alternating pair); the per-phase breakdown with
  # torch profile and timeline at C=1 of ours on V2 and no speculation on
  # V2 (where a depth-0 step of ours_v2 loses to V2's plain step; BREAKDOWN=0
  # skips, BREAKDOWN_ARMS= overrides); then ARMS3 greedy-only at 512
  # tokens into h200_full_c (default K=5, K=7: the twelfth round's missing
  # greedy cells; empty skips), for `sweep.py combine` (RUN3, CONC3 and
  # ARMS3_FLAGS override its folder, concurrencies and greedy-only flag).
  # Optional: LOSSLESS=1 the distribution test, MRV2=1 the MRV2 smoke test,
  # REPLICA=1 GPU 1 benches GPU 0's arms first (h200_sweep_replica).
  ( GPU=1; export CUDA_VISIBLE_DEVICES=1
    if [[ -n ${REPLICA:-} ]]; then
      RUN=h200_sweep_replica sweep "${ARMS:-ours_v2,nospec,ours_async,nospecv1}" --quiet-start none
    fi
    AV_TESTS=${AV_TESTS:-model_runner_v2 or skipmeta or caught_up} av_tests
    [[ -n ${MRV2:-} ]] && mrv2_smoke 1
    [[ -n ${LOSSLESS:-} ]] && lossless_test
    if [[ ${BREAKDOWN:-1} != 0 ]]; then
      BREAKDOWN_CONC=${BREAKDOWN_CONC:-1} BREAKDOWN_TRACE=${BREAKDOWN_TRACE-1} \
        BREAKDOWN_ARMS=${BREAKDOWN_ARMS:-ours_v2 nospec} breakdown 1
    fi
    ARMS3=${ARMS3-k5v1,k7v1}
    [[ -n $ARMS3 ]] && OUTPUT_LEN=512 RUN=${RUN3:-h200_full_c} CONC=${CONC3:-${CONC:-}} \
      sweep "$ARMS3" ${ARMS3_FLAGS---greedy-only} --quiet-start none
  ) &
  LANE1=$!
  OUTPUT_LEN=${OUTPUT_LEN:-512} RUN=${RUN_NAME:-h200_focus} \
    ARMS=${ARMS:-ours_v2,nospec,ours_async,nospecv1} QUIET= main_sweep
  # ARMS_AFTER: a second sweep on GPU 0 once its first is done (RUN_AFTER
  # names its folder), with the engine test against ours' servers in it.
  if [[ -n ${ARMS_AFTER:-} ]]; then
    OUTPUT_LEN=${OUTPUT_LEN:-512} RUN=${RUN_AFTER:-h200_focus_after} ARMS=$ARMS_AFTER QUIET= \
      main_sweep
  fi
  wait $LANE1
  log "done"
  touch "$RES/DONE"
  exit 0
fi
if [[ "${JOB_KIND:-start}" == full ]]; then
  # The sweep's whole arm set in one round, split over the two GPUs in two
  # parts that `sweep.py combine` merges afterwards (every JSON keeps its
  # arm): output capped at 512 tokens, temperature 1 and a greedy pass for
  # every arm. Ours as `vllm serve` gets it with nothing set
  # (`ours_served`: our AV inside Model Runner V2, the draft model in our
  # graphs), against vLLM's fixed K with the V2 drafter in our graphs
  # (`kNg`, the strongest fixed K measured: vLLM's eager V2 drafter and
  # V1's piecewise one are 2-20x slower), no speculation on V2 and vLLM's
  # AV. What is compared most lands on one GPU.
  # GPU 0: vLLM's AV (started first, alone, for its start-up profile on a
  # quiet GPU), ours, ours with the V2 options on (OPTION_ARM, empty
  # skips), no speculation, K=1 and K=3; the engine test against ours'
  # live server.
  # GPU 1: K=5 and K=7, then the ngram family whole: no speculation (the
  # same server as GPU 0's: the two GPUs' control), ours, K=3 and K=7;
  # then AV_TESTS, if set.
  # ARMS= and ARMS2= override (the twelfth round's V1 set:
  # ours_async,nospec,k1v1,k3v1,nospecv1 and vllm_av,k5v1,k7v1,ngram_ours,
  # ngram_k3v1,ngram_k7v1).
  OPTION_ARM=${OPTION_ARM-ours_v2g_ugraphs_skipmeta}
  ( GPU=1; export CUDA_VISIBLE_DEVICES=1
    OUTPUT_LEN=${OUTPUT_LEN:-512} RUN=h200_full_b GREEDY=1 QUIET=none \
      ARMS=${ARMS2:-k5g,k7g,ngram_nospec,ngram_ours_served,ngram_k3,ngram_k7} main_sweep
    # AV_TESTS: greedy tests (a pytest -k selection) once the arms are done.
    [[ -n ${AV_TESTS:-} ]] && av_tests ) &
  LANE1=$!
  OUTPUT_LEN=${OUTPUT_LEN:-512} RUN=h200_full_a GREEDY=1 QUIET=${QUIET-vllm_av} \
    ARMS=${ARMS:-vllm_av,ours_served${OPTION_ARM:+,$OPTION_ARM},nospec,k1g,k3g} main_sweep
  wait $LANE1
  log "done"
  touch "$RES/DONE"
  exit 0
fi
if [[ $NGPU -gt 1 ]]; then
  ( GPU=1; engine_tests 1; breakdown 1; more_arms; mrv2_smoke 1 ) &
  LANE1=$!
  main_sweep
  piecewise_sweep
  wait $LANE1
else
  main_sweep
  engine_tests 0
  breakdown 0
  piecewise_sweep
  more_arms
  mrv2_smoke 0
fi
log "done"
touch "$RES/DONE"
