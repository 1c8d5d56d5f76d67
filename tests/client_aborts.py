"""Many concurrent completions against a live server, some cancelled by the
client mid-flight: the load of the serving tests on the CPU and the GPU."""

from __future__ import annotations

import asyncio
import random


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
