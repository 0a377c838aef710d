"""Load on the speech server: 1,000 streamed requests at 64-way concurrency, about one client in five
disconnecting at a random point. No 5xx, every completed body is exactly the audio of the same request made
alone, every aborted request's blocks come back (the KV pool is full at the end) and the server's memory does
not grow across the run. Bounded in count and time; loopback only."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
from server_helpers import API_KEY, ServerProcess, metric

AUTH = {"Authorization": f"Bearer {API_KEY}"}
REQUESTS, CONCURRENCY = 1000, 64
VARIANTS = [("Short line number one.", 1), ("Another, somewhat longer line to speak.", 2), ("你好，世界。", 3),
            ("Fourth voice line here.", 4)]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def body(i: int) -> dict:
    text, seed = VARIANTS[i % len(VARIANTS)]
    return {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm", "seed": seed}


async def one(client: httpx.AsyncClient, url: str, i: int, leave_after: int | None) -> tuple[int, int | None]:
    """(status, body bytes or None when the client left early)."""
    async with client.stream("POST", url, json=body(i), headers=AUTH) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None
        if leave_after == 0:  # gone once the headers came, before any audio
            return 200, None
        size, chunks = 0, 0
        async for chunk in r.aiter_bytes():
            size += len(chunk)
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return 200, None  # leaving the block closes the connection mid-body
        return 200, size


async def run(url: str, start: int, count: int, rng: random.Random,
              planned: dict[int, int]) -> list[tuple[int, int, int | None]]:
    """``planned``: filled with the clients that mean to leave, by request, after how many chunks (0: at once)."""
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def bounded(i):
            leave = rng.randint(0, 2) if rng.random() < 0.2 else None
            if leave is not None:
                planned[i] = leave
            async with gate:
                return (i, *await one(client, url + "/v1/audio/speech", i, leave))

        return await asyncio.gather(*(bounded(i) for i in range(start, start + count)))


def test_a_thousand_streams_with_disconnects(upstream_ckpt):
    # two malloc arenas: with one per worker thread, freed memory scattered over 64 arenas makes the resident
    # size wander by tens of MiB, which would hide a leak
    srv = ServerProcess(upstream_ckpt, "--max-new-token", "24", "--max-concurrent", str(CONCURRENCY), "--max-queue",
                        str(REQUESTS), env={"MALLOC_ARENA_MAX": "2"})
    try:
        expected = {}
        for i in range(len(VARIANTS)):  # each variant alone first
            r = httpx.post(srv.url + "/v1/audio/speech", json=body(i), headers=AUTH, timeout=60)
            assert r.status_code == 200
            expected[i] = len(r.content)
        rng, results, rss, planned = random.Random(0), [], [], {}
        deadline = time.monotonic() + 600
        for start in range(0, REQUESTS, REQUESTS // 8):
            results += asyncio.run(run(srv.url, start, REQUESTS // 8, rng, planned))
            time.sleep(0.5)  # idle: the server hands its free heap back
            rss.append(rss_mib(srv.proc.pid))
            assert time.monotonic() < deadline, "the load test ran out of time"
        statuses = [s for _, s, _ in results]
        assert len(results) == REQUESTS and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
        completed = [(i, size) for i, _, size in results if size is not None]
        left = {i for i, _, size in results if size is None}
        # those leaving at once always do; a later leaver stays to the end of a body shorter than its plan (how
        # many chunks a body comes in depends on the engine's pace)
        at_once = {i for i, after in planned.items() if after == 0}
        assert at_once <= left <= set(planned) and len(at_once) > REQUESTS // 20, (len(at_once), len(left), len(planned))
        wrong = [(i, size, expected[i % len(VARIANTS)]) for i, size in completed if size != expected[i % len(VARIANTS)]]
        assert not wrong, f"{len(wrong)} bodies differ from the request made alone, e.g. {wrong[:3]}"
        for _ in range(100):  # the aborted requests' blocks are freed within a step
            if metric(srv.url, "chattts_kv_blocks_used") == 0 and metric(srv.url, "chattts_running_requests") == 0:
                break
            time.sleep(0.1)
        assert metric(srv.url, "chattts_kv_blocks_used") == 0
        assert metric(srv.url, "chattts_engine_running") == metric(srv.url, "chattts_engine_waiting") == 0
        print("server RSS (MiB) after each eighth:", [round(r) for r in rss])
        # a leak raises the floor: what the idle server holds at its lowest. Single samples wander by up to ~50 MiB
        # (seen: 1201, 1188, 1230, 1198, 1243, 1251, 1205, 1252), so one sample against another proves nothing
        first, second = min(rss[:4]), min(rss[4:])
        assert second - first < 32, f"the server's idle memory floor grew from {first:.0f} to {second:.0f} MiB"
    finally:
        assert srv.stop() == 0
