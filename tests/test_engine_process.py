"""The engine process's seam, both sides in this process over real pipes (``open_pipes``; an ``EngineHost`` in
a thread, as ``benchmarks/serve_timeline.py --split`` hosts it): the typed messages and their dispatch, the
prompts crossing as plain arrays, ``RemoteAudio`` reading like ``JoinedAudio``, every ``EngineClient`` call of
``RemoteClient`` (what two fronts share included), cancels reaching the engine, and a dead engine failing what
is in flight. The HTTP side of ``serve --engine-process`` is `test_server_process.py`'s."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from seam_helpers import check_cancelled_refine_aborts, engine_is_idle

from chattts_velocity.audio.pump import PENDING, take_ready
from chattts_velocity.engine import EngineStats
from chattts_velocity.params import InferCodeParams, RefineTextParams
from chattts_velocity.serving.client import EngineGoneError, EngineInfo
from chattts_velocity.serving.engine_process.host import EngineHost, EngineSettings
from chattts_velocity.serving.engine_process.messages import (
    AudioBatch,
    AudioItem,
    Call,
    Collect,
    Collected,
    EngineEnds,
    ErrorKind,
    Failed,
    PromptArrays,
    Ready,
    Reply,
    Start,
    Stats,
    open_pipes,
    recv_audio,
    send_audio,
)
from chattts_velocity.serving.engine_process.remote import RemoteClient
from chattts_velocity.serving.engine_process.remote_audio import RemoteAudio
from chattts_velocity.serving.engine_process.shipper import Front, Shipper
from chattts_velocity.serving.kit import SpeechKit
from chattts_velocity.serving.local import LocalClient

TEXT = "One sentence here. And a second one!"


@dataclass(frozen=True)
class Bogus:
    """A message no side knows."""


def code_params(kit: SpeechKit, voices, seed: int = 1, tokens: int = 40) -> InferCodeParams:
    return InferCodeParams(spk_emb=voices.resolve("alloy").spk_emb, manual_seed=seed, max_new_token=tokens,
                           min_new_token=tokens, show_tqdm=False)


def read(audio, timeout: float = 60) -> tuple[np.ndarray, Exception | None]:
    """Every sample of a non-blocking audio (``on_ready``), and the error it ended with."""
    woken = threading.Event()
    audio.on_ready(woken.set)
    parts, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        woken.clear()
        chunk, end, failure = take_ready(audio)
        if chunk is not None and chunk is not PENDING:
            parts.append(chunk)
        if end:
            return np.concatenate(parts) if parts else np.zeros(0, np.float32), failure
        woken.wait(5)
    pytest.fail("the audio did not end")


@contextlib.contextmanager
def hosted(chat, fronts: int = 1):
    """An ``EngineHost`` over ``chat`` in a thread, and a ready ``RemoteClient`` for each front."""
    engine_ends, front_ends = open_pipes(fronts)
    host = EngineHost(LocalClient(chat), engine_ends)
    host.announce()
    serving = threading.Thread(target=host.serve, daemon=True)
    serving.start()
    clients = [RemoteClient(ends, index=i) for i, ends in enumerate(front_ends)]
    try:
        for client in clients:
            client.wait_ready(60)
        yield clients
    finally:
        for client in clients:
            client.close()
        serving.join(30)
        assert not serving.is_alive(), "the host kept serving after every front left"



# ---------------------------------------------------------------------------- no model
def test_remote_audio_reads_like_joined_audio():
    cancelled = []
    blocking = RemoteAudio("a", cancelled.append)  # no on_ready: next waits for the reader thread's chunk
    threading.Timer(0.05, blocking.deliver, (np.ones(3, np.float32),)).start()
    assert next(blocking).tolist() == [1, 1, 1]
    blocking.deliver(None)
    with pytest.raises(StopIteration):
        next(blocking)
    blocking.cancel()  # over: nothing to cancel
    assert cancelled == []

    woken = []
    audio = RemoteAudio("b", cancelled.append)
    audio.on_ready(lambda: woken.append(1))
    assert next(audio) is PENDING
    audio.deliver(np.zeros(2, np.float32))
    audio.deliver(np.ones(2, np.float32))
    audio.deliver(None, "the engine process exited")
    assert len(woken) == 3
    chunk, end, failure = take_ready(audio)  # the chunks first, then the failure
    assert chunk.tolist() == [0, 0, 1, 1] and end and isinstance(failure, RuntimeError)
    assert str(failure) == "the engine process exited"

    left = RemoteAudio("c", cancelled.append)
    left.cancel()
    left.cancel()
    assert cancelled == ["c"]  # once, and nothing arrives after it
    left.deliver(np.ones(1, np.float32))
    with pytest.raises(StopIteration):
        next(left)


class _Recorder:
    """Stands in for a pipe end the host sends on."""

    def __init__(self):
        self.sent = []

    def send(self, msg) -> None:
        self.sent.append(msg)


class _FakeClient:
    info = EngineInfo("cpu", 4)
    kit = None

    def start(self, prompts, params, in_flight):
        raise ValueError("the engine says no")

    async def stats(self):
        return "the stats"


def wait_for(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_host_dispatches_by_type_and_survives_what_it_does_not_know(caplog):
    events = _Recorder()
    host = EngineHost(_FakeClient(), [EngineEnds(None, events, _Recorder())])
    front = host.fronts[0]
    with caplog.at_level(logging.ERROR):
        host.dispatch(front, Bogus())  # an unknown message: logged, nothing answered
    assert "unknown message Bogus" in caplog.text and events.sent == []
    host.dispatch(front, Call("f0.1", Bogus()))  # an unknown call: an error reply
    (reply,) = events.sent
    assert reply == Reply("f0.1", "unknown call Bogus", ErrorKind.INTERNAL)
    with pytest.raises(RuntimeError, match="unknown call Bogus"):
        reply.result()
    host.dispatch(front, Start("f0.2", [], None, 4))  # the engine refuses it: the request fails, alone
    assert events.sent[-1] == Failed("f0.2", "ValueError: the engine says no")
    host.dispatch(front, Call("f0.3", Stats()))  # and the next call is answered (on the calls loop)
    wait_for(lambda: len(events.sent) == 3)
    assert events.sent[-1] == Reply("f0.3", "the stats")


def test_a_dead_engine_fails_what_is_in_flight_and_every_new_request():
    engine_ends, (ends,) = open_pipes(1)
    (engine,) = engine_ends
    kit = SimpleNamespace(speaker_stats=None, config=SimpleNamespace(hidden_size=8))
    engine.events.send(Ready(EngineInfo("cpu", 4), kit))
    client = RemoteClient(ends)
    assert client.wait_ready(10) == EngineInfo("cpu", 4) and client.health() is None
    audio = client.start([], None, 4)

    async def stats_when_gone():
        call = asyncio.ensure_future(client.stats())
        await asyncio.sleep(0.1)
        engine.close()  # the engine process exits
        with pytest.raises(EngineGoneError, match="engine process"):
            await call

    asyncio.run(stats_when_gone())
    samples, failure = read(audio, 10)
    assert samples.size == 0 and isinstance(failure, RuntimeError) and "engine process" in str(failure)
    assert "engine process" in client.health()
    with pytest.raises(EngineGoneError, match="engine process"):
        client.start([], None, 4)
    with pytest.raises(EngineGoneError, match="engine process"):
        asyncio.run(client.refine(["a"], RefineTextParams()))
    client.close()


def test_a_message_whose_handling_fails_does_not_stop_the_front_reading_the_engine(caplog):
    """A handler that raises (here the front's metrics, collected for another front) is logged and answered
    without them; the front's reader threads go on, so later audio and calls still arrive. A reader that died
    would leave every later request of this front waiting for audio that is never read."""
    engine_ends, (ends,) = open_pipes(1)
    (engine,) = engine_ends
    kit = SimpleNamespace(speaker_stats=None, config=SimpleNamespace(hidden_size=8))
    engine.events.send(Ready(EngineInfo("cpu", 4), kit))
    client = RemoteClient(ends)
    client.wait_ready(10)
    fails = iter([True, False])

    def own() -> list:
        if next(fails):
            raise RuntimeError("dictionary changed size during iteration")
        return ["families"]

    client.share_metrics(own)
    engine.events.send(Collect((1, "c1")))
    engine.events.send(Collect((1, "c2")))
    assert engine.cmd.poll(10) and engine.cmd.recv() == Collected((1, "c1"), None)
    assert engine.cmd.poll(10) and engine.cmd.recv() == Collected((1, "c2"), ["families"])
    audio = client.start([], None, 4)
    assert engine.cmd.poll(10) and isinstance(engine.cmd.recv(), Start)
    send_audio(engine.audio, AudioBatch([AudioItem(audio.rid, np.ones(5, np.float32)), AudioItem(audio.rid, None)]))
    samples, failure = read(audio, 10)
    assert failure is None and samples.tolist() == [1.0] * 5
    assert "collecting this front's metrics for another front failed" in caplog.text
    client.close()
    engine.close()


class _Chunks:
    """A finished request's audio as the shipper reads it: ``chunks``, then the end; ``broken``: its cancel
    raises too."""

    def __init__(self, chunks: list, broken: bool = False):
        self._chunks, self._broken = list(chunks), broken
        self.started = False

    def __next__(self):
        if self._chunks:
            return self._chunks.pop(0)
        raise StopIteration

    def on_ready(self, notify) -> None:
        pass

    def start(self) -> None:
        self.started = True
        if self._broken:
            raise RuntimeError("cannot start")

    def cancel(self) -> None:
        if self._broken:
            raise RuntimeError("cannot cancel")


def test_the_shipper_reads_a_request_only_once_its_start_returned():
    """``Shipper.add`` starts the request's audio before the shipper may read it: a chunk ready during ``start``
    (its notify called from inside) waits for ``start`` to return, so a read never runs beside it."""
    engine_ends, (ends,) = open_pipes(1)
    shipper = Shipper()

    class Slow(_Chunks):
        def on_ready(self, notify) -> None:
            self._notify = notify

        def start(self) -> None:
            self._notify()  # the first chunk is ready while start still runs
            time.sleep(0.2)
            self.started = True

        def __next__(self):
            self.read_before_started = getattr(self, "read_before_started", False) or not self.started
            return super().__next__()

    audio = Slow([np.ones(2, np.float32)])
    shipper.add("r", audio, Front(0, engine_ends[0]))
    items = []
    deadline = time.monotonic() + 10
    while len(items) < 2 and ends.audio.poll(max(0.0, deadline - time.monotonic())):
        items += recv_audio(ends.audio).items
    assert [item.chunk.tolist() if item.chunk is not None else None for item in items] == [[1.0, 1.0], None]
    assert audio.started and not audio.read_before_started
    ends.close()
    engine_ends[0].close()


def test_a_request_whose_audio_cannot_be_shipped_fails_alone(caplog):
    """The engine process's one shipper thread serves every front: a request it cannot ship (here chunks that
    do not join, and whose cancel raises as well) ends with the error, and the other request's audio still goes
    out."""
    engine_ends, (ends,) = open_pipes(1)
    shipper = Shipper()
    front = Front(0, engine_ends[0])
    bad_audio, good_audio = _Chunks([np.ones(3, np.float32), np.ones((2, 2), np.float32)], broken=True), \
        _Chunks([np.ones(4, np.float32)])
    shipper.add("bad", bad_audio, front)
    shipper.add("good", good_audio, front)
    assert bad_audio.started and good_audio.started, "the engine works on a request from its arrival on"
    items = []
    deadline = time.monotonic() + 10
    while len(items) < 3 and ends.audio.poll(max(0.0, deadline - time.monotonic())):
        items += recv_audio(ends.audio).items
    bad = [item for item in items if item.rid == "bad"]
    assert len(bad) == 1 and bad[0].chunk is None and "ValueError" in bad[0].failure
    good = [item for item in items if item.rid == "good"]
    assert [item.chunk.tolist() if item.chunk is not None else None for item in good] == [[1.0] * 4, None]
    assert good[-1].failure is None
    assert "shipping request bad's audio failed" in caplog.text
    ends.close()
    engine_ends[0].close()


# ---------------------------------------------------------------------------- with the tiny checkpoint
def test_prompts_cross_the_pipe_as_plain_arrays(chat):
    """What the front sends to run: the prompts its kit made, as numpy arrays (a torch tensor would be pickled as
    shared memory whose descriptor the engine process fetches back from the front), and they come out equal to
    what the one-process path builds from the same request."""
    local = LocalClient(chat)
    kit = pickle.loads(pickle.dumps(local.kit))  # as the front gets it
    p = code_params(kit, local.voices, seed=3)
    prompts, params = kit.prompts(kit.prepare_texts(TEXT), p)
    expected = chat.pipeline.code_prompts(chat.prepare_texts(TEXT), p)
    assert len(prompts) == len(expected) == 2
    buf = io.BytesIO()
    ForkingPickler(buf).dump(Start("f0.0", [PromptArrays.of(q) for q in prompts], params, 4))
    assert b"torch" not in buf.getvalue()
    got = pickle.loads(buf.getvalue())
    assert got.params == params == chat.pipeline.code_params(p)
    for arrays, want in zip(got.prompts, expected, strict=True):
        prompt = arrays.prompt()
        assert torch.equal(prompt.ids, want.ids) and torch.equal(prompt.text_mask, want.text_mask)
        assert torch.equal(prompt.speaker, want.speaker)


def test_a_request_the_engine_process_refuses_ends_its_audio_with_the_error(chat, caplog):
    """The front prepared and validated a request, but the engine process refuses it all the same: its audio
    (whose headers are out) ends with the engine's error instead of hanging, and the engine process goes on
    serving, past a message it does not know."""
    with hosted(chat) as (front,):
        prompts, params = front.kit.prompts(["Refused by the engine."], code_params(front.kit, front.voices))

        def refuse(*args, **kwargs):
            raise ValueError("the engine says no")

        chat.pipeline.joined = refuse
        try:
            samples, failure = read(front.start(prompts, params, 4))
        finally:
            del chat.pipeline.joined
        assert samples.size == 0 and isinstance(failure, RuntimeError) and "the engine says no" in str(failure)
        with caplog.at_level(logging.ERROR):
            front.ends.cmd.send(Bogus())
            samples, failure = read(front.start(prompts, params, 4))  # the engine process serves the next one
        assert failure is None and samples.size > 0
        assert "unknown message Bogus" in caplog.text
    assert engine_is_idle(chat)


def test_remote_audio_equals_local_audio_and_calls_answer(chat):
    local = LocalClient(chat)
    p = code_params(local.kit, local.voices, seed=5)
    prompts, params = local.kit.prompts(local.kit.prepare_texts(TEXT), p)
    want, failure = read(local.start(prompts, params, 4))
    assert failure is None and want.size > 0
    refine = RefineTextParams(manual_seed=2, max_new_token=12, show_tqdm=False)
    with hosted(chat) as (front,):
        assert front.info == local.info
        got, failure = read(front.start(prompts, params, 4))
        # the same tokens; windows decoded in batches of another make-up differ in float rounding only
        assert failure is None and got.size == want.size and np.allclose(got, want, rtol=0, atol=1e-5)

        async def calls():
            return await front.refine(["hello world", "a b c"], refine), await front.stats()

        refined, stats = asyncio.run(calls())
        assert refined == chat.pipeline.refine_texts(["hello world", "a b c"], refine)
        assert isinstance(stats, EngineStats) and stats.num_generated_tokens > 0
        with pytest.raises(ValueError, match="transcript"):  # the engine's ValueError, raised here as one
            asyncio.run(front.register_voice("nobody", np.zeros(24000, np.float32), "  "))
    assert engine_is_idle(chat)


def test_two_fronts_share_voices_and_metrics(chat):
    rng = np.random.default_rng(0)
    wav = (0.3 * rng.standard_normal(24000)).astype(np.float32)
    with hosted(chat, fronts=2) as (a, b):
        a.share_metrics(lambda: ["a's families"])
        b.share_metrics(lambda: ["b's families"])
        voice = asyncio.run(a.register_voice("mine", wav, " what is said "))
        assert voice.spk_smp == chat.sample_audio_speaker(wav) and voice.txt_smp == "what is said"
        assert a.voices.resolve(voice.id) == voice
        wait_for(lambda: voice in b.voices.list())  # relayed by the engine process
        assert asyncio.run(a.peer_metrics()) == [["b's families"]]
        assert asyncio.run(b.peer_metrics()) == [["a's families"]]
        prompts, params = a.kit.prompts(["short"], code_params(a.kit, a.voices))
        ours, theirs = a.start(prompts, params, 1), b.start(prompts, params, 1)
        assert ours.rid.startswith("f0.") and theirs.rid.startswith("f1.")  # request ids carry the front's index
        ours.cancel()
        theirs.cancel()
        b.close()  # a front that left is not waited for
        assert asyncio.run(a.peer_metrics()) == []


def test_cancels_reach_the_engine(chat):
    """A cancelled audio, a cancelled refine call and a front that leaves each abort their engine requests."""
    long = " ".join(f"Sentence {i} of a request that is cancelled early." for i in range(6))
    with hosted(chat, fronts=2) as (a, b):
        p = code_params(a.kit, a.voices, tokens=300)
        prompts, params = a.kit.prompts(a.kit.prepare_texts(long), p)
        before = chat.engine.stats().engine.num_generated_tokens
        audio = a.start(prompts, params, 4)
        audio.on_ready(lambda: None)
        wait_for(lambda: take_ready(audio)[0] is not None, 60)  # generating
        audio.cancel()
        assert engine_is_idle(chat)
        left = b.start(prompts, params, 4)
        left.on_ready(lambda: None)
        wait_for(lambda: take_ready(left)[0] is not None, 60)
        b.close()
        assert engine_is_idle(chat)
        assert chat.engine.stats().engine.num_generated_tokens - before < 2 * 6 * 300  # neither ran to its end

        check_cancelled_refine_aborts(a, chat)


def test_the_engine_process_serves_its_fronts_and_exits_when_they_left(upstream_ckpt):
    """``start_engine`` spawns it: it ignores SIGTERM (its fronts drain, then leave), serves every front, and
    exits cleanly once the last one left."""
    load = {"source": "custom", "custom_path": upstream_ckpt, "device": "cpu"}
    first = RemoteClient.start_engine(load, EngineSettings(audio_round_ms=0, log_level="warning"), fronts=2)
    (ends,) = first.peers
    second = RemoteClient(ends, index=1)
    try:
        assert first.wait_ready(300) == second.wait_ready(60) and first.info.device == "cpu"
        os.kill(first.process.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert first.process.is_alive() and first.health() is None
        for front in (first, second):
            prompts, params = front.kit.prompts(["Served by the engine process."], code_params(front.kit, front.voices))
            samples, failure = read(front.start(prompts, params, 4))
            assert failure is None and samples.size > 0
        second.close()
        first.process.join(1)
        assert first.process.is_alive()  # the first front still uses it
    finally:
        first.close()
    assert first.process.exitcode == 0


@pytest.mark.parametrize("writes", ["whole", "partial", "no-writev"])
def test_audio_batches_cross_the_pipe_with_their_samples_out_of_band(monkeypatch, writes):
    """``send_audio``/``recv_audio``: batches of chunks (small, past the pipe's buffer, empty, not contiguous),
    ends and failures arrive whole and in order, as writable arrays, with no sample in the pickled part; where
    the system writes only part of what ``writev`` is given, the rest follows; without ``os.writev`` the pipe's
    own writes carry the same messages."""
    from chattts_velocity.serving.engine_process import messages

    if writes == "no-writev":
        monkeypatch.delattr(messages.os, "writev")
    if writes == "partial":  # at most 1,000 bytes a call, cut anywhere
        writev = os.writev

        def short(fd, views):
            left, cut = 1000, []
            for view in views:
                cut.append(memoryview(view)[:left])
                left -= cut[-1].nbytes
                if not left:
                    break
            return writev(fd, cut)

        monkeypatch.setattr(messages.os, "writev", short)
    rng = np.random.default_rng(0)
    big = rng.standard_normal(200_000).astype(np.float32)  # past the pipe's 64 KiB: the writer waits for the reader
    batches = [
        AudioBatch([AudioItem("a", rng.standard_normal(5).astype(np.float32)), AudioItem("b", big),
                    AudioItem("c", np.zeros(0, np.float32)), AudioItem("d", big[::2]), AudioItem("a", None),
                    AudioItem("e", None, "RuntimeError: boom")]),
        AudioBatch([]),
        AudioBatch([AudioItem("f", None)]),
        AudioBatch([AudioItem("g", big[:7])]),
    ]
    buffers: list = []
    pickle.dumps(batches[0], protocol=5, buffer_callback=buffers.append)
    assert sum(b.raw().nbytes for b in buffers) >= big.nbytes, "the large chunks go out of band"
    ends = open_pipes(1)
    reader, writer = ends[1][0].audio, ends[0][0].audio
    got: list = []
    thread = threading.Thread(target=lambda: got.extend(recv_audio(reader) for _ in batches))
    thread.start()
    for batch in batches:
        send_audio(writer, batch)
    thread.join(30)
    assert not thread.is_alive() and len(got) == len(batches)
    for sent, received in zip(batches, got, strict=True):
        assert [(i.rid, i.failure) for i in received.items] == [(i.rid, i.failure) for i in sent.items]
        for a, b in zip(sent.items, received.items, strict=True):
            assert (a.chunk is None) == (b.chunk is None)
            if a.chunk is not None:
                assert b.chunk.dtype == np.float32 and np.array_equal(a.chunk, b.chunk) and b.chunk.flags.writeable
    for end in (*ends[0], *ends[1]):
        end.close()
