"""The realtime socket (``/v1/audio/speech/stream``) against a live server on 127.0.0.1 over a tiny checkpoint,
with the ``websockets`` client: text appended in pieces of any size speaks the HTTP route's exact samples, two
contexts on one socket each their own, a barge-in frees the engine at once, every bad message gets an error
event on a socket that goes on, the three ways to give the API key, idle and non-reading clients dropped with
their slots freed, and 200 sockets that cancel and vanish at random leave the engine empty."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time

import pytest
from realtime_helpers import (
    AUTH,
    Heard,
    assert_same_samples,
    hear,
    http_pcm,
    next_event,
    open_session,
    send,
    speak,
    ws_url,
)
from server_helpers import API_KEY, ServerProcess, metric
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from chattts_velocity.server.settings import ServerConfig

TOKENS = 24
"""Audio tokens of every sentence (--min-new-token = --max-new-token): short audio of a fixed length."""
TEXT = "Hello there. This is a test. And a third one."
ENGINE_EMPTY = ("chattts_kv_blocks_used", "chattts_engine_running", "chattts_engine_waiting",
                "chattts_running_requests", "chattts_queue_depth")


@pytest.fixture(scope="module")
def server(upstream_ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("realtime") / "server.log"
    srv = ServerProcess(upstream_ckpt, "--max-new-token", str(TOKENS), "--min-new-token", str(TOKENS),
                        "--max-input-chars", "400", "--log-level", "info", log_path=str(log))
    srv.log_file = log
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def strict_server(upstream_ckpt):
    """One running slot and no queue, a 2 s idle timeout and a 1 s send timeout."""
    srv = ServerProcess(upstream_ckpt, "--max-new-token", str(TOKENS), "--min-new-token", str(TOKENS),
                        "--max-concurrent", "1", "--max-queue", "0", "--ws-idle-timeout", "2", "--ws-send-timeout", "1")
    yield srv
    assert srv.stop() == 0


def wait_engine_empty(server, timeout: float = 10, also: tuple[str, ...] = ()) -> None:
    """Until the engine holds no sequence and no KV block, and no request is admitted."""
    deadline = time.monotonic() + timeout
    while True:
        values = {name: metric(server.url, name) for name in (*ENGINE_EMPTY, *also)}
        if not any(values.values()):
            return
        assert time.monotonic() < deadline, values
        time.sleep(0.05)


def words(text: str) -> list[str]:
    parts = text.split(" ")
    return [w + " " for w in parts[:-1]] + [parts[-1]]


def test_the_socket_limits_are_validated():
    for name, bad in (("ws_max_contexts", 0), ("ws_idle_timeout_s", 0.0), ("ws_send_timeout_s", -1.0)):
        with pytest.raises(ValueError, match=name):
            ServerConfig(**{name: bad})


def test_appends_of_any_size_speak_the_http_routes_samples(server):
    want = http_pcm(server, TEXT, seed=7)
    splits = {"characters": list(TEXT), "words": words(TEXT),
              "sentences": ["Hello there. ", "This is a test. ", "And a third one."]}

    async def run() -> dict[str, Heard]:
        async with await open_session(server) as ws:
            await send(ws, "session.update", session={"voice": "echo", "seed": 7})
            assert (await next_event(ws))["session"]["seed"] == 7
            return {name: await speak(ws, name, pieces) for name, pieces in splits.items()}

    for name, heard in asyncio.run(run()).items():
        assert not heard.errors, (name, heard.errors)
        assert_same_samples(heard.pcm, want)
        assert heard.seqs == list(range(len(heard.seqs)))
        assert heard.done["usage"]["input_characters"] == len(TEXT)
        assert heard.done["usage"]["audio_seconds"] == pytest.approx(want.size / 24000, abs=1e-3)
        assert [s["text"] for s in heard.segments] == splits["sentences"], name
        spans = [(s["start_s"], s["end_s"]) for s in heard.segments]
        assert spans[0][0] == 0, (name, spans)
        assert all(a[1] == pytest.approx(b[0]) for a, b in zip(spans, spans[1:], strict=False)), spans
        assert spans[-1][1] == pytest.approx(want.size / 24000, abs=1e-3)


def test_two_contexts_interleaved_on_one_socket_each_speak_their_solo_audio(server):
    a_text, b_text = "First voice speaks here. It has two sentences.", "Second one differs. Also two of them."
    want = {"a": http_pcm(server, a_text, seed=3, voice="alloy"), "b": http_pcm(server, b_text, seed=4, voice="nova")}

    async def run() -> dict[str, Heard]:
        async with await open_session(server) as ws:
            a, b = words(a_text), words(b_text)
            # a context's settings are the session's at its first append
            await send(ws, "session.update", session={"voice": "alloy", "seed": 3})
            await send(ws, "input_text.append", context_id="a", text=a[0])
            await send(ws, "session.update", session={"voice": "nova", "seed": 4})
            for i in range(max(len(a), len(b))):
                for cid, pieces in (("a", a[1:]), ("b", b)):
                    if i < len(pieces):
                        await send(ws, "input_text.append", context_id=cid, text=pieces[i])
            await send(ws, "input_text.end", context_id="b")
            await send(ws, "input_text.end", context_id="a")
            heard = {"a": Heard(), "b": Heard()}
            others = await hear(ws, heard)
            assert [e["type"] for e in others] == ["session.updated", "session.updated"]
            return heard

    for cid, heard in asyncio.run(run()).items():
        assert not heard.errors, heard.errors
        assert_same_samples(heard.pcm, want[cid])


def test_cancel_mid_sentence_stops_the_audio_and_frees_the_engine_at_once(server):
    text = " ".join(f"Sentence {i} goes on." for i in range(16)) + " And one cut off"
    before = metric(server.url, "chattts_ws_cancels_total", default=0)
    tokens = metric(server.url, "chattts_generated_tokens")

    async def run() -> tuple[Heard, Heard]:
        async with await open_session(server) as ws:
            await send(ws, "session.update", session={"seed": 5})
            await next_event(ws)
            await send(ws, "input_text.append", context_id="c", text=text)
            heard = {"c": Heard()}
            await hear(ws, heard, until=lambda h: h["c"].chunks)
            await send(ws, "context.cancel", context_id="c")
            await hear(ws, heard)
            assert heard["c"].cancelled and heard["c"].done is None
            with pytest.raises(TimeoutError):  # nothing more of it
                await next_event(ws, timeout=0.5)
            await asyncio.to_thread(wait_engine_empty, server, 5)
            # the socket goes on, and the id may be used again
            return heard["c"], await speak(ws, "c", ["Back again. ", "Still here."])

    cancelled, again = asyncio.run(run())
    assert not cancelled.audio_after_end and not cancelled.errors
    # every sentence generates exactly TOKENS: all 16 would have made 16 * TOKENS, "again" 2 * TOKENS
    assert metric(server.url, "chattts_generated_tokens") - tokens < (16 + 2) * TOKENS
    assert metric(server.url, "chattts_ws_cancels_total") == before + 1
    assert not again.errors
    assert_same_samples(again.pcm, http_pcm(server, "Back again. Still here.", seed=5, voice="alloy"))


BAD_MESSAGES = [
    ("not json", "invalid_json", None),
    ("[1, 2]", "invalid_message", None),
    (json.dumps({"type": "speak"}), "invalid_message", None),
    (json.dumps({"context_id": "x"}), "invalid_message", None),
    (json.dumps({"type": "input_text.append", "text": "hi"}), "invalid_message", "context_id"),
    (json.dumps({"type": "input_text.append", "context_id": 5, "text": "hi"}), "invalid_message", "context_id"),
    (json.dumps({"type": "input_text.append", "context_id": "", "text": "hi"}), "invalid_message", "context_id"),
    (json.dumps({"type": "input_text.append", "context_id": "x", "text": 5}), "invalid_message", "text"),
    (json.dumps({"type": "input_text.append", "context_id": "x"}), "invalid_message", "text"),
    (json.dumps({"type": "session.update", "session": "fast"}), "invalid_message", "session"),
    (json.dumps({"type": "session.update", "session": {"speed": 10}}), "invalid_settings", "speed"),
    (json.dumps({"type": "session.update", "session": {"top_k": "many"}}), "invalid_settings", "top_k"),
    (json.dumps({"type": "session.update", "session": {"voice": "nobody"}}), "invalid_settings", "voice"),
    (json.dumps({"type": "session.update", "session": {"volume": 2}}), "invalid_settings", "volume"),
    (json.dumps({"type": "session.update", "session": {"refine_text": True}}), "invalid_settings", "refine_text"),
    (json.dumps({"type": "session.update", "session": {"response_format": "mp3"}}), "unsupported_format",
     "response_format"),
    (json.dumps({"type": "session.update", "session": {"response_format": "midi"}}), "invalid_settings",
     "response_format"),
    (json.dumps({"type": "input_text.flush", "context_id": "nobody"}), "unknown_context", None),
    (json.dumps({"type": "input_text.end", "context_id": "nobody"}), "unknown_context", None),
    (json.dumps({"type": "context.cancel", "context_id": "nobody"}), "unknown_context", None),
    (json.dumps({"type": "input_text.append", "context_id": "big", "text": "a" * 401}), "text_too_long", None),
]


def test_every_malformed_message_gets_an_error_and_the_socket_goes_on(server):
    async def run() -> None:
        async with await open_session(server) as ws:
            for frame, code, param in BAD_MESSAGES:
                await ws.send(frame)
                event = await next_event(ws)
                assert event["type"] == "error" and event["code"] == code, (frame, event)
                assert event.get("param") == param, (frame, event)
            await ws.send(b"\x00binary")
            assert (await next_event(ws))["code"] == "invalid_message"
            await too_many_contexts(ws)
            await buffered_text_over_the_cap(ws)
            await append_after_end(ws)
            # the refused updates changed nothing, and the socket still speaks
            await send(ws, "session.update", session={"seed": 9})
            assert (await next_event(ws))["session"] == {
                "voice": "alloy", "response_format": "pcm", "speed": 1.0, "seed": 9, "temperature": 0.3,
                "top_p": 0.7, "top_k": 20, "prompt": None, "refine_text": False}
            heard = await speak(ws, "good", words(TEXT))
            assert not heard.errors
            assert_same_samples(heard.pcm, await asyncio.to_thread(http_pcm, server, TEXT, 9, "alloy"))

    asyncio.run(run())
    wait_engine_empty(server)


async def too_many_contexts(ws) -> None:
    for i in range(8):  # open: nothing to speak yet (no sentence end)
        await send(ws, "input_text.append", context_id=f"open{i}", text="waiting")
    await send(ws, "input_text.append", context_id="one more", text="waiting")
    event = await next_event(ws)
    assert (event["code"], event["context_id"]) == ("too_many_contexts", "one more"), event
    for i in range(8):
        await send(ws, "context.cancel", context_id=f"open{i}")
    heard = {f"open{i}": Heard() for i in range(8)}
    await hear(ws, heard)
    assert all(h.cancelled and not h.chunks for h in heard.values())


async def buffered_text_over_the_cap(ws) -> None:
    await send(ws, "input_text.append", context_id="buf", text="a" * 300)
    await send(ws, "input_text.append", context_id="buf", text="a" * 101)
    event = await next_event(ws)
    assert (event["code"], event["context_id"]) == ("text_too_long", "buf"), event
    await send(ws, "context.cancel", context_id="buf")
    assert (await next_event(ws))["type"] == "context.cancelled"


async def append_after_end(ws) -> None:
    await send(ws, "input_text.append", context_id="e", text="Hi there. " * 4)
    await send(ws, "input_text.end", context_id="e")
    await send(ws, "input_text.append", context_id="e", text="more")
    await send(ws, "input_text.flush", context_id="e")
    heard = {"e": Heard()}
    await hear(ws, heard)
    assert [e["code"] for e in heard["e"].errors] == ["context_ended", "context_ended"], heard["e"].errors
    assert heard["e"].done is not None and heard["e"].pcm.size == 4 * (2 * TOKENS - 1) * 256


def test_the_api_key_is_required_in_one_of_three_forms(server):
    key_protocol = f"chattts-velocity.bearer.{API_KEY}"

    async def refused(first: dict | None = None, **kw) -> tuple[dict, int]:
        ws = await connect(ws_url(server), **kw)
        if first is not None:  # no key in the handshake: the server waits for the first message
            await ws.send(json.dumps(first))
        event = await next_event(ws)
        with pytest.raises(ConnectionClosed) as closed:
            await next_event(ws)
        return event, closed.value.rcvd.code

    async def accepted(first: dict | None = None, **kw) -> str | None:
        async with connect(ws_url(server), **kw) as ws:
            if first is not None:
                await ws.send(json.dumps(first))
            assert (await next_event(ws))["type"] == "session.created"
            heard = await speak(ws, "k", ["Keyed."])
            assert heard.done is not None
            return ws.subprotocol

    async def run() -> None:
        for kw in ({"first": {"type": "session.update", "session": {"seed": 1}}},
                   {"first": {"type": "auth", "api_key": "wrong"}},
                   {"additional_headers": {"Authorization": "Bearer wrong"}},
                   {"subprotocols": ["chattts-velocity.bearer.wrong"]}):
            event, code = await refused(**kw)
            assert (event["type"], event["code"], code) == ("error", "invalid_api_key", 1008), (kw, event)
            assert API_KEY not in json.dumps(event)
        assert await accepted(additional_headers=AUTH) is None
        assert await accepted({"type": "auth", "api_key": API_KEY}) is None
        assert await accepted(subprotocols=[key_protocol]) == key_protocol
        assert await accepted(subprotocols=["chattts-velocity", key_protocol]) == "chattts-velocity"

    asyncio.run(run())
    log = server.log_file.read_text()
    assert "WebSocket /v1/audio/speech/stream" in log and API_KEY not in log


def test_an_idle_socket_is_closed(strict_server):
    async def run() -> tuple[dict, int, float]:
        async with await open_session(strict_server) as ws:
            start = time.monotonic()
            event = await next_event(ws, timeout=10)
            with pytest.raises(ConnectionClosed) as closed:
                await next_event(ws)
            return event, closed.value.rcvd.code, time.monotonic() - start

    event, code, waited = asyncio.run(run())
    assert (event["code"], code) == ("idle_timeout", 1000), event
    assert 1.9 <= waited < 6
    wait_engine_empty(strict_server, also=("chattts_ws_sockets",))


def test_a_client_that_stops_reading_is_dropped_and_its_slot_freed(strict_server):
    """The server has one running slot and no queue: the honest client after the stuck one is admitted only if
    the stuck one's slot came back."""
    port = int(strict_server.url.rsplit(":", 1)[1])

    async def stuck() -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        ws = await open_session(strict_server, sock=sock, max_queue=1)
        await send(ws, "input_text.append", context_id="flood", text="Go on. " * 300)
        await send(ws, "input_text.end", context_id="flood")
        # the event loop stands still: this client reads nothing more
        deadline = time.monotonic() + 30
        while metric(strict_server.url, "chattts_ws_sockets") > 0:
            assert time.monotonic() < deadline, "the server kept a client that reads nothing"
            time.sleep(0.1)
        ws.transport.abort()

    asyncio.run(stuck())
    wait_engine_empty(strict_server)

    async def honest() -> Heard:
        async with await open_session(strict_server) as ws:
            return await speak(ws, "h", ["Now I listen. ", "Every word."])

    heard = asyncio.run(honest())
    assert not heard.errors and heard.pcm.size == 2 * (2 * TOKENS - 1) * 256
    assert metric(strict_server.url, 'chattts_requests_total{route="/v1/audio/speech/stream",status="send_timeout"}') == 1


def test_200_sockets_with_random_cancels_and_disconnects_leave_the_engine_empty(server):
    rng = random.Random(0)
    before = metric(server.url, "chattts_ws_contexts_total", default=0)

    async def one(i: int, action: str) -> None:
        ws = await open_session(server)
        await send(ws, "input_text.append", context_id="x", text=f"Socket {i} speaks. Then it goes on")
        if action == "vanish":  # the TCP connection dropped, no close handshake
            ws.transport.abort()
            return
        heard = {"x": Heard()}
        if action in ("cancel", "leave"):
            await hear(ws, heard, until=lambda h: h["x"].chunks)
        if action == "cancel":
            await send(ws, "context.cancel", context_id="x")
        elif action == "end":
            await send(ws, "input_text.end", context_id="x")
        if action in ("cancel", "end"):
            await hear(ws, heard)
            assert heard["x"].cancelled == (action == "cancel") and not heard["x"].audio_after_end
        if action == "close":
            await send(ws, "session.close")
            with pytest.raises(ConnectionClosed):
                while True:
                    await next_event(ws)
        await ws.close()

    async def run() -> None:
        actions = [rng.choice(["vanish", "cancel", "leave", "end", "close"]) for _ in range(200)]
        for start in range(0, 200, 25):
            await asyncio.gather(*(one(i, actions[i]) for i in range(start, start + 25)))

    asyncio.run(run())
    wait_engine_empty(server, also=("chattts_ws_sockets",))
    assert metric(server.url, "chattts_ws_contexts_total") == before + 200


def test_a_draining_server_starts_no_new_context(chat):
    """Once a graceful shutdown began, an append that would open a context is refused (the socket stays usable)."""
    from fastapi.testclient import TestClient

    from chattts_velocity.server.app import build_app
    from chattts_velocity.server.settings import ServerConfig
    from chattts_velocity.serving.local import LocalClient

    app = build_app(LocalClient(chat), ServerConfig(max_new_token=24, min_new_token=24))
    with TestClient(app) as http, http.websocket_connect("/v1/audio/speech/stream") as ws:
        assert ws.receive_json()["type"] == "session.created"
        app.state.speech.draining = True
        ws.send_json({"type": "input_text.append", "context_id": "late", "text": "Too late. "})
        refused = ws.receive_json()
        assert refused["type"] == "error" and refused["code"] == "shutting_down"
        assert refused["context_id"] == "late" and refused["retry_after_s"] == 5
        ws.send_json({"type": "session.update", "session": {"seed": 3}})
        assert ws.receive_json()["type"] == "session.updated"
    assert app.state.speech.admission.running == app.state.speech.admission.waiting == 0
