#!/usr/bin/env bash
# GPU tests in the foreground, on the lent machine once the kit has staged
# vLLM 0.32 (no model pair needed: the tests build tiny models).
#
#   bash scripts/gpu/tests.sh <seconds> tests/gpu/test_gpu_lossless.py -k mtp
#
# Runs pytest -v -s under a time limit with our plugin registered, writes the
# whole log to $OUT (or /tmp/results), prints the verdict lines and the
# distribution checks' p-values.
set -u
limit=$1; shift
out=${OUT:-/tmp/results}; mkdir -p "$out"
source .gpu/tools/env.sh
[ -d /tmp/site_av ] || python3 scripts/gpu/register_plugin.py /tmp/site_av >/dev/null
export PYTHONPATH=/tmp/site_av:$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
log="$out/$(echo "$*" | tr -c 'a-zA-Z0-9_' '_' | cut -c1-60).log"
start=$(date +%s)
timeout "$limit" python3 -m pytest -v -s "$@" > "$log" 2>&1
echo "exit $? after $(( $(date +%s) - start )) s; log $log"
grep -a "p-values\|PASSED\|FAILED\|SKIPPED\|passed\|failed\|Error" "$log" | cut -c1-400 | tail -40
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
