"""The client side of ``bench serve --realtime``: what one socket of a level does (open a session, append a
context's text at an LLM's pace, read its audio, interrupt it) and the probe that times cancel to KV blocks free.
Every figure is a ``perf_counter`` reading of the client process that made it."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import time
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from ..constants import SAMPLE_RATE
from .playback import StreamRecord

ROUTE = "/v1/audio/speech/stream"
CONTEXT = "answer"
ANSWER = ("Sure, here is what I found about your question.",
          "The train leaves at seven and arrives just after nine.",
          "Let me know if you would like me to book a seat for you.")
KV_POLL_S = 0.02
"""How often the probe reads ``chattts_kv_blocks_used`` from ``/metrics`` after its cancels."""
PROBE_SENTENCES = 32
"""At least this many sentences in a probe context: several times what a context generates at once (a server's
``in_flight_sentences``, 4 by default), so that its blocks are still in use when it is cancelled at its first
audio, even on a small model whose next sentences may all finish within the probe's read of ``/metrics`` on a
busy machine."""
CLOSE_S = 10.0
"""How long a socket waits for the server to close it after ``session.close``."""


@dataclass(frozen=True)
class RealtimeBenchConfig:
    """One ``bench serve --realtime`` run."""

    url: str = "http://127.0.0.1:8000"
    streams: tuple[int, ...] = (1, 64)
    """Sockets per level, one context each."""
    words_per_s: float = 15.0
    """How fast each context's text is appended, word by word (an LLM writing)."""
    barge_in: float = 0.2
    """Share of each level's contexts cancelled at their first audio (at least one when > 0)."""
    sentences: int = 3
    """Sentences of each context's text."""
    api_key: str | None = None
    voice: str = "alloy"
    timeout_s: float = 300.0
    """Longest a context may take; a level's client processes get this plus a minute."""
    json_path: str | None = "bench_realtime.json"
    streams_per_process: int = 16
    """Sockets driven by one client process (as ``ServeBenchConfig.streams_per_process``)."""
    kv_timeout_s: float = 10.0
    """Longest the probe waits for the KV blocks to come back."""

    def __post_init__(self) -> None:
        if not self.streams or any(not isinstance(n, int) or n < 1 for n in self.streams):
            raise ValueError(f"--streams must be ints >= 1, got {self.streams!r}")
        if not self.words_per_s > 0:
            raise ValueError(f"--words-per-s must be > 0, got {self.words_per_s!r}")
        if not 0 <= self.barge_in <= 1:
            raise ValueError(f"--barge-in must be a fraction from 0 to 1, got {self.barge_in!r}")
        if not isinstance(self.sentences, int) or self.sentences < 1:
            raise ValueError(f"--sentences must be an int >= 1, got {self.sentences!r}")
        if not isinstance(self.streams_per_process, int) or self.streams_per_process < 1:
            raise ValueError(f"--streams-per-process must be an int >= 1, got {self.streams_per_process!r}")
        ws_url(self.url)


def ws_url(url: str) -> str:
    """The realtime route's ``ws://`` (``wss://``) address on the server at ``url`` (http or ws)."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.hostname:
        raise ValueError(f"--url must be a server address like http://127.0.0.1:8000, got {url!r}")
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + ROUTE, "", ""))


def require_websockets() -> None:
    """Fail before the run when the WebSocket client is missing."""
    try:
        import websockets.asyncio.client  # noqa: F401
    except ImportError:
        raise ValueError("bench serve --realtime needs websockets >= 13: pip install 'websockets>=13' (the "
                         "server extra's uvicorn[standard] brings it)") from None


def words(sentences: int) -> tuple[list[str], int]:
    """The appends of one context (each word with its trailing space, so a sentence's end is seen in the append
    that holds it) and the index of the one that ends the first sentence."""
    text = [ANSWER[i % len(ANSWER)] for i in range(sentences)]
    return [w + " " for w in " ".join(text).split()], len(text[0].split()) - 1


def barged(i: int, n: int, fraction: float) -> bool:
    """Whether context ``i`` of ``n`` is interrupted: ``ceil(fraction * n)`` of them, spread evenly."""
    k = math.ceil(fraction * n)
    return (i * k) // n != ((i + 1) * k) // n


@dataclass
class ContextRun:
    """What one context saw, in ``perf_counter`` seconds of its client process."""

    barge: bool
    first_end: float | None = None
    arrivals: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    segments: int = 0
    cancel_sent: float | None = None
    cancelled: float | None = None
    after_cancelled: int = 0
    usage: dict | None = None
    error: str | None = None

    def result(self) -> dict:
        heard = [(t, s) for t, s in zip(self.arrivals, self.samples, strict=True)
                 if self.cancel_sent is None or t <= self.cancel_sent]
        record = StreamRecord([t - heard[0][0] for t, _ in heard], [s for _, s in heard]) if heard else None
        done = self.usage is not None or self.cancelled is not None
        cancel = self.cancel_sent
        late = [t - cancel for t in self.arrivals if cancel is not None and t > cancel]
        return dict(
            ok=self.error is None and done and bool(self.arrivals), error=self.error, barged=self.barge,
            first_audio_s=self.arrivals[0] - self.first_end if self.arrivals and self.first_end else None,
            underrun=record.underrun() if record else None, audio_s=sum(self.samples) / SAMPLE_RATE,
            usage_audio_s=(self.usage or {}).get("audio_seconds"), segments=self.segments,
            cancel_sent=self.cancel_sent is not None,
            cancelled_s=self.cancelled - self.cancel_sent if self.cancelled and self.cancel_sent else None,
            last_audio_s=max(late, default=0.0) if self.cancel_sent is not None else None,
            after_cancelled=self.after_cancelled)


def _send(ws, kind: str, **fields):
    return ws.send(json.dumps({"type": kind, **fields}))


async def _expect(ws, kind: str) -> dict:
    msg = json.loads(await ws.recv())
    if msg.get("type") != kind:
        raise RuntimeError(f"expected {kind}, got {msg.get('type')}: {msg.get('code')} {msg.get('message')}")
    return msg


async def open_socket(cfg: RealtimeBenchConfig, seed: int):
    """A connected socket, its session set to ``cfg.voice`` and ``seed``."""
    from websockets.asyncio.client import connect  # optional: require_websockets says how to install it

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    # no per-message deflate: compressing base64 audio costs both ends CPU and would be timed as the server's
    ws = await connect(ws_url(cfg.url), additional_headers=headers, compression=None, max_size=None,
                       open_timeout=60)
    try:
        await asyncio.wait_for(_expect(ws, "session.created"), 60)
        await _send(ws, "session.update", session={"voice": cfg.voice, "seed": seed})
        await asyncio.wait_for(_expect(ws, "session.updated"), 60)
    except BaseException:
        await ws.close()
        raise
    return ws


async def _write(ws, run: ContextRun, cfg: RealtimeBenchConfig) -> None:
    """Append the text word by word at ``cfg.words_per_s``, then end the context; stop at a cancel."""
    appends, first_end = words(cfg.sentences)
    start = time.perf_counter()
    for k, word in enumerate(appends):
        await asyncio.sleep(max(0.0, start + k / cfg.words_per_s - time.perf_counter()))
        if run.cancel_sent is not None:
            return
        await _send(ws, "input_text.append", context_id=CONTEXT, text=word)
        if k == first_end:
            run.first_end = time.perf_counter()
    await _send(ws, "input_text.end", context_id=CONTEXT)


async def _read(ws, run: ContextRun, deadline) -> None:
    """Every event of the socket until the server closes it: after ``audio.done``, ``context.cancelled`` or an
    error the session is closed, and what arrives meanwhile is still counted."""
    closing = False
    async for raw in ws:
        now, msg = time.perf_counter(), json.loads(raw)
        kind = msg.get("type")
        if kind == "audio.delta":
            if run.cancelled is not None:
                run.after_cancelled += 1
                continue
            run.arrivals.append(now)
            run.samples.append(len(base64.b64decode(msg["audio"])) // 2)
            if run.barge and run.cancel_sent is None:
                run.cancel_sent = time.perf_counter()
                await _send(ws, "context.cancel", context_id=CONTEXT)
            continue
        if kind == "speech.segment":
            run.segments += 1
            continue
        if kind == "audio.done":
            run.usage = msg.get("usage", {})
        elif kind == "context.cancelled":
            run.cancelled = now
        elif kind == "error" and run.usage is None and run.cancelled is None:  # else: a cancel that came late
            run.error = run.error or f"{msg.get('code')}: {msg.get('message')}"[:300]
        else:
            continue
        if not closing:  # the context is over: the server closes the socket after this
            closing = True
            deadline.reschedule(min(deadline.when(), asyncio.get_running_loop().time() + CLOSE_S))
            await _send(ws, "session.close")


async def run_context(ws, cfg: RealtimeBenchConfig, barge: bool) -> dict:
    """One context on its own socket, from the first append to the socket's close."""
    run = ContextRun(barge)
    writer = asyncio.create_task(_write(ws, run, cfg))
    try:
        async with asyncio.timeout(cfg.timeout_s) as deadline:
            await _read(ws, run, deadline)
        if writer.done() and writer.exception() is not None and run.usage is None and run.cancelled is None:
            raise writer.exception()
    except Exception as e:  # noqa: BLE001 - a failed context is counted, not fatal
        run.error = run.error or f"{type(e).__name__} after {len(run.arrivals)} audio deltas: {e!r}"[:300]
    finally:
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        await ws.close()
    return run.result()


def kv_blocks_used(cfg: RealtimeBenchConfig) -> float:
    """``chattts_kv_blocks_used`` from the server's ``GET /metrics``."""
    parts = urlsplit(ws_url(cfg.url))
    base = urlunsplit(({"ws": "http", "wss": "https"}[parts.scheme], parts.netloc,
                       parts.path.removesuffix(ROUTE) + "/metrics", "", ""))
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    with urllib.request.urlopen(urllib.request.Request(base, headers=headers), timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("chattts_kv_blocks_used "):
                return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"{base} has no chattts_kv_blocks_used")


async def settled_blocks(cfg: RealtimeBenchConfig) -> float:
    """The blocks in use once back at 0 (work that just ended frees its blocks within an engine window or so), or
    after ``cfg.kv_timeout_s`` whatever they are (someone else's work holds them)."""
    used = await asyncio.to_thread(kv_blocks_used, cfg)
    for _ in range(int(cfg.kv_timeout_s / KV_POLL_S)):
        if used == 0:
            break
        await asyncio.sleep(KV_POLL_S)
        used = await asyncio.to_thread(kv_blocks_used, cfg)
    return used


async def _probe_context(ws, cfg: RealtimeBenchConfig, heard: asyncio.Event, seen: dict) -> None:
    """Append the whole text (not ended), set ``heard`` at its first audio, note when ``context.cancelled``
    arrives and count the audio after it, until the server closes the socket."""
    text = "".join(words(max(cfg.sentences, PROBE_SENTENCES))[0])
    await _send(ws, "input_text.append", context_id=CONTEXT, text=text)
    try:
        async for raw in ws:
            msg = json.loads(raw)
            if msg.get("type") == "audio.delta":
                heard.set()
                seen["late"] += "cancelled" in seen
            elif msg.get("type") == "context.cancelled":
                seen["cancelled"] = time.perf_counter()
                await _send(ws, "session.close")
            elif msg.get("type") == "error":
                raise RuntimeError(f"KV probe: {msg.get('code')}: {msg.get('message')}")
    finally:
        heard.set()  # a reader that ended or failed keeps no one waiting


async def _poll_until_freed(cfg: RealtimeBenchConfig, before: float, sent: float) -> list[tuple[float, float]]:
    """(seconds after ``sent``, blocks in use), read every ``KV_POLL_S`` until back at ``before`` or timed out."""
    polls = []
    for i in range(int(cfg.kv_timeout_s / KV_POLL_S) + 1):
        await asyncio.sleep(max(0.0, sent + i * KV_POLL_S - time.perf_counter()))
        used = await asyncio.to_thread(kv_blocks_used, cfg)
        polls.append((time.perf_counter() - sent, used))
        if used <= before:
            break
    return polls


async def kv_probe(cfg: RealtimeBenchConfig, k: int) -> dict:
    """Cancel to KV blocks free, with ``k`` contexts on sockets of their own (``realtime.DEFINITIONS``)."""
    before = await settled_blocks(cfg)
    socks = await asyncio.gather(*(open_socket(cfg, 1_000_000 + i) for i in range(k)))
    heard, seen = [asyncio.Event() for _ in socks], [{"late": 0} for _ in socks]
    readers = [asyncio.create_task(_probe_context(ws, cfg, h, c))
               for ws, h, c in zip(socks, heard, seen, strict=True)]
    try:
        async with asyncio.timeout(cfg.timeout_s):
            await asyncio.gather(*(h.wait() for h in heard))
            for task in readers:
                if task.done():  # a reader ends only after context.cancelled, or by failing
                    task.result()
                    raise RuntimeError("KV probe: the server closed a socket before its cancel")
            held = await asyncio.to_thread(kv_blocks_used, cfg)
            await asyncio.gather(*(_send(ws, "context.cancel", context_id=CONTEXT) for ws in socks))
            sent = time.perf_counter()
            polls = await _poll_until_freed(cfg, before, sent)
            await asyncio.gather(*readers)
    finally:
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await asyncio.gather(*(ws.close() for ws in socks), return_exceptions=True)
    freed = polls[-1][1] <= before
    return dict(kv_probe_contexts=k, kv_blocks_before_probe=before, kv_blocks_held=held,
                kv_free_ms=1e3 * polls[-1][0] if freed else None,
                kv_free_after_ms=(1e3 * polls[-2][0] if len(polls) > 1 else 0.0) if freed else None,
                kv_probe_cancelled_max_ms=max((1e3 * (c["cancelled"] - sent) for c in seen if "cancelled" in c),
                                              default=None),
                kv_probe_audio_after_cancelled=sum(c["late"] for c in seen))
