"""The main job: serve the real model pair three ways, send real prompts, summarise.

    python -m vllm_av.demo [--arms ours,nospec,k3] [--concurrency 1,4]
                           [--max-tokens 64] [--num-prompts 4] [--out FILE]

Arms: `ours` (draft_model, K=7, enable_adaptive_verification), `nospec`
(the target alone) and `k3` (draft_model, fixed K=3). For each arm we start
`vllm serve` (the `vllm` command next to this Python) in its own process
group, wait for /health, send one warm-up request, then for each
concurrency C send max(num_prompts, C) streaming requests from C client
threads, scraping /metrics before and after so that counters are deltas of
that level alone. Then the server's process group gets SIGTERM (SIGKILL if
it lingers) and the next arm starts. Prompts alternate HumanEval (plain
completion, /v1/completions) and MT-Bench first turns (/v1/chat/completions),
greedy, `ignore_eos` so every request produces exactly max_tokens tokens and
the arms do the same work.

This module talks HTTP only (standard library); it never imports vLLM.

Figures, per arm and concurrency:
- output tok/s: all output tokens / wall time of the level;
- tok/s per user: mean over requests of (output tokens - 1) / (last chunk
  time - first chunk time), the decode rate one user sees after the first
  token (queueing and prefill excluded; they are in ttft);
- accepted tokens per step: vLLM's spec-decode counters,
  accepted / num_drafts + 1 (the +1 is the token the target samples itself);
- drafted / verified / accepted / trimmed draft tokens: our `vllm_av:*`
  counters for `ours`; vLLM's counters for fixed K (verified = drafted,
  trimmed = 0);
- acceptance per position (ours): `vllm_av:acceptance_observed`, the
  conditional acceptance at each draft position over the whole run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from vllm_av.models.specs import DRAFT, TARGET, cache_root, checkpoint_dir

# Largest draft for `ours`: the budget trims it per step, so no K to tune.
OURS_K = 7
FIXED_K = 3
ARMS = ("ours", "nospec", "k3")
# 1 GiB of KV cache: 26k tokens for the 1.5B target, far more than
# 4 requests x 2048 tokens need, and small beside the 24 GB machines we run on.
KV_CACHE_BYTES = 1 << 30
SERVED_NAME = "target"
_START = time.monotonic()


def say(message: str) -> None:
    print(f"[main_job demo {time.monotonic() - _START:5.0f}s] {message}", flush=True)


# ---------------------------------------------------------------- arms


def speculative_config(arm: str, draft: str) -> dict | None:
    """The --speculative-config of an arm (None: no speculation)."""
    if arm == "nospec":
        return None
    if arm == "ours":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": OURS_K,
                "enable_adaptive_verification": True}
    if arm == "k3":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": FIXED_K}
    raise ValueError(f"unknown arm {arm!r}; arms are {', '.join(ARMS)}")


def serve_command(vllm_bin: str, target: str, draft: str, arm: str, port: int,
                  max_num_seqs: int, kv_cache_bytes: int = KV_CACHE_BYTES) -> list[str]:
    cmd = [vllm_bin, "serve", target, "--served-model-name", SERVED_NAME,
           "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "bfloat16", "--max-model-len", "2048",
           "--max-num-seqs", str(max_num_seqs),
           "--kv-cache-memory-bytes", str(kv_cache_bytes),
           # Eager: the CPU backend's Inductor warm-up takes several minutes
           # on 2 cores, longer than the whole measurement.
           "--enforce-eager"]
    spec = speculative_config(arm, draft)
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


def serve_env() -> dict:
    env = dict(os.environ)
    # Our start-up cost profile need only cover the steps this job runs:
    # max_num_seqs requests x (1 + K) tokens, plus prefill chunks, which the
    # cost model extrapolates linearly.
    env.setdefault("VLLM_AV_PROFILE_MAX_TOKENS", "64")
    env.setdefault("VLLM_AV_PROFILE_REPEATS", "3")
    # A fresh snapshot every step, so the last scrape of a level is exact.
    env.setdefault("VLLM_AV_METRICS_INTERVAL", "1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` in its own process group, logged to a file."""

    def __init__(self, cmd: list[str], env: dict, port: int, log_path: Path) -> None:
        self.cmd, self.env, self.port, self.log_path = cmd, env, port, log_path
        self.base = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> float:
        """Start and wait for /health; return the seconds it took."""
        t0 = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        last_note = t0
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with status {self.proc.returncode}; "
                                   f"last lines of {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise TimeoutError(f"vllm serve not healthy after {timeout_s:.0f} s; "
                                   f"last lines of {self.log_path}:\n{self.log_tail()}")
            if now - last_note > 30:
                say(f"  still starting ({now - t0:.0f} s): {self.last_log_line()}")
                last_note = now
            time.sleep(2)

    def stop(self, grace_s: float = 60) -> None:
        """SIGTERM the process group, SIGKILL it if anything is left after grace_s."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # The leader may be gone while engine-core/worker children linger.
        deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _group_alive(pgid):
            say(f"  process group {pgid} still alive after SIGTERM; sending SIGKILL")
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        self.proc = None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def last_log_line(self) -> str:
        tail = self.log_tail(1).strip()
        return tail[-140:] if tail else "(no output yet)"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# ---------------------------------------------------------------- prompts and requests


def load_prompts(prompt_dir: Path, num: int) -> list[dict]:
    """`num` prompts alternating HumanEval and MT-Bench first turns, in file order."""
    sets = {}
    for name in ("humaneval", "mtbench"):
        path = prompt_dir / f"{name}.jsonl"
        with open(path) as f:
            sets[name] = [json.loads(line) for line in f if line.strip()]
    out = []
    for i in range(num):
        name = ("humaneval", "mtbench")[i % 2]
        row = sets[name][i // 2 % len(sets[name])]
        if name == "humaneval":
            out.append({"set": name, "id": row["id"], "endpoint": "/v1/completions",
                        "body": {"prompt": row["prompt"]}})
        else:
            out.append({"set": name, "id": row["id"], "endpoint": "/v1/chat/completions",
                        "body": {"messages": row["messages"][:1]}})
    return out


def stream_request(base: str, prompt: dict, max_tokens: int, temperature: float,
                   timeout_s: float = 600) -> dict:
    """Send one streaming request; return its timings and token count."""
    body = {"model": SERVED_NAME, **prompt["body"], "max_tokens": max_tokens,
            "temperature": temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(base + prompt["endpoint"], data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    chunk_times: list[float] = []
    usage = None
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                usage = event["usage"]
            choices = event.get("choices") or []
            if any(_chunk_text(c) for c in choices):
                chunk_times.append(time.monotonic() - t0)
    n_out = usage["completion_tokens"] if usage else len(chunk_times)
    return request_timing(prompt["set"], n_out, chunk_times, time.monotonic() - t0)


def _chunk_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


def request_timing(set_name: str, output_tokens: int, chunk_times: list[float],
                   latency_s: float) -> dict:
    """Timings of one request from the arrival times (s after sending) of its chunks.

    With speculation a chunk may carry several tokens, so the per-user rate
    counts tokens, not chunks: (output_tokens - 1) tokens arrived between the
    first chunk (which holds the one token sampled after prefill) and the last.
    """
    ttft = chunk_times[0] if chunk_times else latency_s
    decode_s = chunk_times[-1] - chunk_times[0] if len(chunk_times) > 1 else 0.0
    per_user = (output_tokens - 1) / decode_s if decode_s > 0 and output_tokens > 1 else None
    return {"set": set_name, "output_tokens": output_tokens, "ttft_s": round(ttft, 4),
            "latency_s": round(latency_s, 4), "decode_s": round(decode_s, 4),
            "chunks": len(chunk_times), "tok_s_per_user": per_user}


def run_level(base: str, prompts: list[dict], concurrency: int, max_tokens: int,
              temperature: float) -> tuple[list[dict], float]:
    """max(len(prompts), concurrency) requests from `concurrency` threads; (results, wall s)."""
    n = max(len(prompts), concurrency)
    todo: queue.Queue = queue.Queue()
    for i in range(n):
        todo.put(prompts[i % len(prompts)])
    results: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                p = todo.get_nowait()
            except queue.Empty:
                return
            try:
                r = stream_request(base, p, max_tokens, temperature)
            except BaseException as e:  # reported below, in the main thread
                with lock:
                    errors.append(e)
                return
            with lock:
                results.append(r)
                say(f"    request {len(results)}/{n} ({r['set']}): {r['output_tokens']} tokens "
                    f"in {r['latency_s']:.1f} s")

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, first: {errors[0]!r}")
    return results, wall


# ---------------------------------------------------------------- /metrics


def parse_metrics(text: str, prefixes: tuple[str, ...] = ("vllm_av:", "vllm:spec_decode")) -> dict:
    """Prometheus text -> {name: {label tuple: value}} for names with one of `prefixes`.

    Label tuples are sorted (key, value) pairs without `engine`/`model_name`,
    so `{position="2"}` becomes (("position", "2"),). `_created` samples
    (timestamps) are dropped.
    """
    out: dict[str, dict[tuple, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or not line.startswith(prefixes):
            continue
        head, _, value = line.rpartition(" ")
        name, labels = head, ()
        if "{" in head:
            name, _, rest = head.partition("{")
            labels = tuple(sorted(
                (k, v) for k, v in _parse_labels(rest.rstrip("}"))
                if k not in ("engine", "model_name")))
        if name.endswith("_created"):
            continue
        out.setdefault(name, {})[labels] = float(value)
    return out


def _parse_labels(s: str):
    i = 0
    while i < len(s):
        eq = s.index("=", i)
        key = s[i:eq].strip().lstrip(",").strip()
        j = eq + 2  # past ="
        val = []
        while s[j] != '"':
            if s[j] == "\\":
                j += 1
            val.append(s[j])
            j += 1
        yield key, "".join(val)
        i = j + 1


def scrape(base: str) -> dict:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode())


def counter(metrics: dict, name: str) -> float:
    """Unlabelled counter value, with or without the `_total` suffix; 0 if absent."""
    for key in (name, name + "_total"):
        if key in metrics and () in metrics[key]:
            return metrics[key][()]
    return 0.0


def by_label(metrics: dict, name: str, label: str) -> dict[int, float]:
    """{int(label value): value} of a series labelled by `label`."""
    series = metrics.get(name) or metrics.get(name + "_total") or {}
    return {int(dict(k)[label]): v for k, v in series.items() if label in dict(k)}


def per_position(metrics: dict, name: str) -> list[float]:
    by_pos = by_label(metrics, name, "position")
    return [by_pos[i] for i in sorted(by_pos)]


def spec_figures(arm: str, before: dict, after: dict) -> dict:
    """Draft-token counts of one level (deltas) and the accepted tokens per step."""
    def d(name: str) -> float:
        return counter(after, name) - counter(before, name)

    num_drafts = d("vllm:spec_decode_num_drafts")
    vllm_drafted = d("vllm:spec_decode_num_draft_tokens")
    vllm_accepted = d("vllm:spec_decode_num_accepted_tokens")
    out = {"num_drafts": num_drafts,
           "accepted_per_step": vllm_accepted / num_drafts + 1 if num_drafts > 0 else None}
    if arm == "ours":
        out.update({k: d(f"vllm_av:draft_tokens_{k}")
                    for k in ("drafted", "verified", "accepted", "trimmed")})
        out["vllm_counted_draft_tokens"] = vllm_drafted
        out["vllm_counted_accepted_tokens"] = vllm_accepted
        # Steps of this level at each drafting depth (adaptive depth).
        name = "vllm_av:depth_chosen_steps"
        start = by_label(before, name, "depth")
        steps = {k: v - start.get(k, 0.0) for k, v in sorted(by_label(after, name, "depth").items())}
        if any(steps.values()):
            out["steps_by_depth"] = steps
    elif num_drafts > 0:
        out.update({"drafted": vllm_drafted, "verified": vllm_drafted,
                    "accepted": vllm_accepted, "trimmed": 0.0})
    return out


def av_acceptance(metrics: dict) -> dict:
    return {"observed": per_position(metrics, "vllm_av:acceptance_observed"),
            "predicted": per_position(metrics, "vllm_av:acceptance_predicted"),
            "budget": counter(metrics, "vllm_av:budget")}


# ---------------------------------------------------------------- summary


def level_summary(arm: str, concurrency: int, results: list[dict], wall_s: float,
                  before: dict, after: dict) -> dict:
    total = sum(r["output_tokens"] for r in results)
    rates = [r["tok_s_per_user"] for r in results if r["tok_s_per_user"] is not None]
    return {"arm": arm, "concurrency": concurrency, "num_requests": len(results),
            "output_tokens": total, "wall_s": round(wall_s, 3),
            "output_tok_s": total / wall_s if wall_s > 0 else None,
            "tok_s_per_user": sum(rates) / len(rates) if rates else None,
            "mean_ttft_s": sum(r["ttft_s"] for r in results) / len(results) if results else None,
            "spec": spec_figures(arm, before, after), "requests": results}


def _fmt(x, spec: str) -> str:
    """format(x, spec), or a dash as wide as the spec's width when x is None."""
    if x is None:
        width = spec.split(".")[0]
        return "-".rjust(int(width) if width.isdigit() else 1)
    return format(x, spec)


def format_table(levels: list[dict], acceptance: dict[str, dict]) -> str:
    head = (f"{'arm':<7} {'C':>2} {'out tok/s':>9} {'tok/s/user':>10} {'acc/step':>8} "
            f"{'drafted':>8} {'verified':>8} {'accepted':>8} {'trimmed':>8}")
    lines = [head, "-" * len(head)]
    for lv in levels:
        s = lv["spec"]
        lines.append(
            f"{lv['arm']:<7} {lv['concurrency']:>2} {_fmt(lv['output_tok_s'], '9.2f')} "
            f"{_fmt(lv['tok_s_per_user'], '10.2f')} {_fmt(s.get('accepted_per_step'), '8.2f')} "
            + " ".join(_fmt(s.get(k), "8.0f")
                       for k in ("drafted", "verified", "accepted", "trimmed")))
    for lv in levels:
        steps = lv["spec"].get("steps_by_depth")
        if steps:
            total = sum(steps.values())
            shares = "  ".join(f"{d}: {100 * n / total:.0f}%" for d, n in steps.items() if n)
            lines.append(f"{lv['arm']} C={lv['concurrency']} steps by drafting depth "
                         f"({total:.0f} steps): {shares}")
    for arm, acc in acceptance.items():
        if acc.get("observed"):
            obs = " ".join(f"{p:.2f}" for p in acc["observed"])
            pred = " ".join(f"{p:.2f}" for p in acc.get("predicted") or [])
            lines.append(f"{arm} acceptance per position, observed:  {obs}")
            if pred:
                lines.append(f"{arm} acceptance per position, predicted: {pred}")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def run_arm(arm: str, args, target: str, draft: str, prompts: list[dict],
            log_dir: Path) -> dict:
    max_seqs = max(args.concurrency)
    port = free_port()
    vllm_bin = str(Path(sys.executable).with_name("vllm"))
    cmd = serve_command(vllm_bin, target, draft, arm, port, max_seqs, args.kv_cache_bytes)
    server = Server(cmd, serve_env(), port, log_dir / f"serve_{arm}.log")
    say(f"{arm}: starting vllm serve on port {port} (log {server.log_path})")
    record: dict = {"arm": arm, "command": server.cmd, "levels": []}
    try:
        record["startup_s"] = round(server.start(args.startup_timeout), 1)
        say(f"{arm}: ready in {record['startup_s']:.0f} s; warm-up request")
        stream_request(server.base, prompts[0], 8, args.temperature)
        for c in args.concurrency:
            n = max(len(prompts), c)
            say(f"{arm}: concurrency {c}, {n} requests x {args.max_tokens} tokens")
            before = scrape(server.base)
            results, wall = run_level(server.base, prompts, c, args.max_tokens, args.temperature)
            after = scrape(server.base)
            lv = level_summary(arm, c, results, wall, before, after)
            record["levels"].append(lv)
            say(f"{arm}: C={c} {lv['output_tok_s']:.2f} tok/s, "
                f"{_fmt(lv['tok_s_per_user'], '.2f')} tok/s per user, "
                f"{_fmt(lv['spec'].get('accepted_per_step'), '.2f')} tokens per step")
        if arm == "ours":
            record["av"] = av_acceptance(after)
    finally:
        say(f"{arm}: stopping the server")
        server.stop()
    return record


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(prog="python -m vllm_av.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS), help="comma list of ours,nospec,k3")
    ap.add_argument("--concurrency", default="1,4", help="comma list of client concurrencies")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--num-prompts", type=int, default=4,
                    help="prompts per level, alternating HumanEval / MT-Bench (a level sends "
                         "max(this, C) requests)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--kv-cache-bytes", type=int, default=KV_CACHE_BYTES)
    ap.add_argument("--startup-timeout", type=float, default=900,
                    help="seconds to wait for /health")
    ap.add_argument("--cache-dir",
                    help="model/prompt cache (default $VLLM_AV_CACHE or ~/.cache/vllm-av)")
    ap.add_argument("--out", help="JSON summary (default benchmarks/results/main_job_<date>.json)")
    args = ap.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arm(s) {', '.join(unknown)}; arms are {', '.join(ARMS)}")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not args.concurrency or min(args.concurrency) < 1 or args.num_prompts < 1:
        ap.error("--concurrency and --num-prompts must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, through run_arm's `finally`, so the
    # server's process group is stopped rather than orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(__file__).resolve().parents[1]
    stamp = dt.datetime.now().strftime("%Y%m%d_%H%M%S")
    out = Path(args.out) if args.out else root / "benchmarks" / "results" / f"main_job_{stamp}.json"
    log_dir = out.with_suffix("").with_name(out.stem + "_logs")
    target = str(checkpoint_dir(TARGET, args.cache_dir))
    draft = str(checkpoint_dir(DRAFT, args.cache_dir))
    prompts = load_prompts(cache_root(args.cache_dir) / "prompts", args.num_prompts)
    say(f"arms {args.arms}, concurrency {args.concurrency}, {args.num_prompts} prompts, "
        f"{args.max_tokens} tokens each; target {target}, draft {draft}")

    summary = {"date": dt.datetime.now().isoformat(timespec="seconds"),
               "argv": sys.argv[1:] if argv is None else argv,
               "config": {k: v for k, v in vars(args).items()},
               "prompts": [{"set": p["set"], "id": p["id"]} for p in prompts], "arms": {}}
    t0 = time.monotonic()
    for arm in args.arms:
        summary["arms"][arm] = run_arm(arm, args, target, draft, prompts, log_dir)
    summary["wall_s"] = round(time.monotonic() - t0, 1)

    levels = [lv for a in summary["arms"].values() for lv in a["levels"]]
    acceptance = {a: r["av"] for a, r in summary["arms"].items() if "av" in r}
    table = format_table(levels, acceptance)
    summary["table"] = table
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n{table}\n", flush=True)
    say(f"done in {summary['wall_s']:.0f} s (servers and requests); summary {out}, "
        f"server logs {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
