"""A client of the realtime socket (``/v1/audio/speech/stream``) for the tests: open a session, send messages,
read every context's events until it is done, and the HTTP route's samples to compare with."""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass, field

import httpx
import numpy as np
from server_helpers import API_KEY
from websockets.asyncio.client import ClientConnection, connect

PATH = "/v1/audio/speech/stream"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def ws_url(server) -> str:
    return "ws" + server.url.removeprefix("http") + PATH


async def open_session(server, headers: dict | None = None, **kw) -> ClientConnection:
    """A socket past its ``session.created`` (authenticated with the header unless ``headers`` says else)."""
    ws = await connect(ws_url(server), additional_headers=AUTH if headers is None else headers, **kw)
    created = await next_event(ws)
    assert created["type"] == "session.created", created
    return ws


async def send(ws: ClientConnection, type_: str, **fields) -> None:
    await ws.send(json.dumps({"type": type_, **fields}))


async def next_event(ws: ClientConnection, timeout: float = 30) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


@dataclass
class Heard:
    """What the socket sent for one context."""

    chunks: list[bytes] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    segments: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    done: dict | None = None
    cancelled: bool = False
    audio_after_end: bool = False
    """An audio.delta or segment arrived after audio.done or context.cancelled."""

    @property
    def pcm(self) -> np.ndarray:
        return np.frombuffer(b"".join(self.chunks), dtype="<i2")

    @property
    def finished(self) -> bool:
        return self.done is not None or self.cancelled

    def take(self, event: dict) -> None:
        kind = event["type"]
        if kind in ("audio.delta", "speech.segment") and self.finished:
            self.audio_after_end = True
        if kind == "audio.delta":
            self.chunks.append(base64.b64decode(event["audio"]))
            self.seqs.append(event["seq"])
        elif kind == "speech.segment":
            self.segments.append(event)
        elif kind == "audio.done":
            self.done = event
        elif kind == "context.cancelled":
            self.cancelled = True
        elif kind == "error":
            self.errors.append(event)


async def hear(ws: ClientConnection, heard: dict[str, Heard], until=None, timeout: float = 60) -> list[dict]:
    """Read events into ``heard`` (by context id; unknown ids are added) until ``until(heard)`` (default:
    every context finished); the events without a context id."""
    until = until or (lambda h: all(c.finished for c in h.values()))
    others = []
    deadline = asyncio.get_running_loop().time() + timeout
    while not until(heard):
        event = await next_event(ws, deadline - asyncio.get_running_loop().time())
        if "context_id" in event:
            heard.setdefault(event["context_id"], Heard()).take(event)
        else:
            others.append(event)
    return others


async def speak(ws: ClientConnection, context_id: str, pieces: list[str], timeout: float = 60) -> Heard:
    """Append ``pieces`` one message each, end, and read the context to its audio.done."""
    for piece in pieces:
        await send(ws, "input_text.append", context_id=context_id, text=piece)
    await send(ws, "input_text.end", context_id=context_id)
    heard = {context_id: Heard()}
    await hear(ws, heard, timeout=timeout)
    return heard[context_id]


def http_pcm(server, text: str, seed: int, voice: str = "echo") -> np.ndarray:
    """``POST /v1/audio/speech``'s samples (pcm) for ``text``."""
    body = {"model": "tts-1", "voice": voice, "input": text, "response_format": "pcm", "seed": seed}
    r = httpx.post(server.url + "/v1/audio/speech", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return np.frombuffer(r.content, dtype="<i2")


def assert_same_samples(got: np.ndarray, want: np.ndarray) -> None:
    """Equal as int16 within 1 LSB (windows decoded in batches of another make-up differ in float rounding)."""
    assert got.size == want.size, (got.size, want.size)
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
    assert diff.max(initial=0) <= 1, diff.max()
