#!/usr/bin/env bash
# The shortest side-by-side round: after the last vLLM chunk (no model
# staging), random weights of the real pair's shapes (scripts/gpu/random_pair.py,
# from the target's config and tokenizer carried in .gpu/randcfg/qwen15),
# then plain V2 and ours as served, one engine each, into $OUT.
#   bash .gpu/tools/stage.sh .gpu/c13 && bash scripts/gpu/random_side_by_side.sh
#   (carry .gpu/c13, .gpu/tools, .gpu/prompts, .gpu/randcfg)
# RSB_CONC (default 64,256), RSB_REPEATS (default 8), RSB_ARMS (default
# nospec,ours_served) override. Tokens and acceptance of random weights
# mean nothing: host costs per step only.
set -u
source .gpu/tools/env.sh
python3 scripts/gpu/register_plugin.py /tmp/site_av >/dev/null
export PYTHONPATH=/tmp/site_av:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
OUT=${OUT:-/tmp/results}
mkdir -p "$OUT"
t0=$(date +%s)
python3 scripts/gpu/random_pair.py --hf .gpu/randcfg/qwen15 --out /tmp/rand > "$OUT/random_pair.log" 2>&1 \
  || { tail -20 "$OUT/random_pair.log"; exit 1; }
echo "[random side by side] pair built in $(( $(date +%s) - t0 )) s"
python3 scripts/gpu/side_by_side.py --arms "${RSB_ARMS:-nospec,ours_served}" \
  --concurrency "${RSB_CONC:-64,256}" --repeats "${RSB_REPEATS:-8}" \
  --target /tmp/rand/qwen15 --draft /tmp/rand/qwen05 --gpu-spans --cpus 0-7 --python-speed \
  --out "$OUT/side_by_side.json" > "$OUT/side_by_side.log" 2>&1
echo "[random side by side] exit $? after $(( $(date +%s) - t0 )) s"
grep -a "started in\|^\[C=\|Error" "$OUT/side_by_side.log" | cut -c1-400 | tail -40
