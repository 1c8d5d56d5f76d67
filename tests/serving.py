"""`vllm serve` for the serving tests on the CPU and the GPU: start one and
wait for it, stop it whole, load it with concurrent completions some of
which the client cancels, read our counters from /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command() -> list[str]:
    exe = Path(sys.executable).parent / "vllm"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


@contextlib.contextmanager
def started_server(args: list[str], env: dict, log_path: Path, timeout_s: float):
    """`vllm serve ARGS --host 127.0.0.1 --port P` in its own process group;
    yields its base URL once /health answers, stops the whole group after."""
    import requests

    port = free_port()
    cmd = vllm_command() + ["serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.time() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited: {Path(log_path).read_text()[-3000:]}")
                try:
                    if requests.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.time() > deadline:
                    raise RuntimeError(f"server did not start in {timeout_s:.0f} s")
                time.sleep(1)
            yield base
        finally:
            stop(proc)


def stop(proc) -> None:
    """SIGTERM the process group, SIGKILL after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def av_metrics(text: str) -> dict[str, float]:
    """Our samples (vllm_av:*) of a /metrics page: name{labels} -> value."""
    values = {}
    for line in text.splitlines():
        if line.startswith("vllm_av:") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def completions_with_client_aborts(base: str, body_of, num_requests: int, abort_every: int,
                                   seed: int = 0, timeout_s: float = 240.0) -> int:
    """POST body_of(i) to /v1/completions for i in 0..num_requests-1 at once
    (streaming or not, as the body says), cancel every `abort_every`-th
    request at a random moment, and check that every other one finished with
    status 200. Returns how many finished."""
    import aiohttp

    rng = random.Random(seed)

    async def one(session, i):
        async with session.post(f"{base}/v1/completions", json=body_of(i)) as r:
            assert r.status == 200, await r.text()
            await r.read()
        return i

    async def main():
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tasks = [asyncio.create_task(one(session, i)) for i in range(num_requests)]
            aborted = set()
            for i in range(0, num_requests, abort_every):
                await asyncio.sleep(rng.uniform(0.0, 0.05))
                tasks[i].cancel()
                aborted.add(i)
            return aborted, await asyncio.gather(*tasks, return_exceptions=True)

    aborted, results = asyncio.run(main())
    done = 0
    for i, res in enumerate(results):
        if i in aborted and isinstance(res, asyncio.CancelledError):
            continue
        assert res == i, f"request {i}: {res!r}"
        done += 1
    return done
