"""Incremental streaming decode (chattts_velocity.audio.stream) on the tiny random checkpoint: streamed audio
against the offline decode for many push patterns, linear decode work, cross-stream batching, first-audio
latency, and the errors for misuse."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from chattts_velocity.audio import AudioStream, StreamConfig, Window, decode_windows
from chattts_velocity.constants import SAMPLES_PER_TOKEN

DEFAULT = StreamConfig()
EXACT = StreamConfig(left_context=52, lookahead=52)


def _tokens(chat, n: int, use_decoder: bool, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if use_decoder:
        return torch.randn(n, chat.model.config.hidden_size, generator=gen)  # [n, H]
    return torch.randint(0, 625, (n, 4), generator=gen)  # [n, 4]


def _pieces(n: int, pattern: str, seed: int = 0) -> list[int]:
    """Push sizes adding up to n: one token at a time, random sizes (zeros included), or all at once."""
    if pattern == "one":
        return [1] * n
    if pattern == "all":
        return [n]
    rng, sizes = np.random.default_rng(seed), []
    while sum(sizes) < n:
        sizes.append(min(int(rng.integers(0, 40)), n - sum(sizes)))
    return sizes


def _stream(
    chat, tokens, use_decoder: bool, config: StreamConfig = DEFAULT, pattern: str = "all", seed: int = 0
):
    """Push ``tokens`` in pieces, decoding whatever is ready after each push; -> (wav, stream)."""
    stream, out, at = AudioStream(config), [], 0
    for size in _pieces(tokens.shape[0], pattern, seed):
        stream.push(tokens[at : at + size])
        at += size
        out += _decode(chat, stream.ready(), use_decoder)
    stream.push(tokens[:0], finished=True)
    out += _decode(chat, stream.ready(), use_decoder)
    assert stream.done
    return np.concatenate(out) if out else np.zeros(0, np.float32), stream


def _decode(chat, windows: list[Window], use_decoder: bool) -> list[np.ndarray]:
    wavs = decode_windows(chat.audio, windows, use_decoder)
    return [w.stream.accept(w, wav) for w, wav in zip(windows, wavs, strict=True)]


def _offline(chat, tokens, use_decoder: bool) -> np.ndarray:
    return chat.audio.to_wavs([tokens], use_decoder)[0]


def _at_once(chat, tokens, config: StreamConfig) -> np.ndarray:
    """The streamed audio of ``tokens`` (hidden states) pushed all at once: what a pump's feed must deliver."""
    stream = AudioStream(config)
    stream.push(tokens, finished=True)
    return np.concatenate(_decode(chat, stream.ready(), True))


def _hold_decodes(pump):
    """Make ``pump``'s decodes wait for a gate: -> (gate, entered, names of the threads that decoded)."""
    import threading

    gate, entered, threads = threading.Event(), threading.Event(), []
    decode = pump.decode

    def held(windows, use_decoder):
        threads.append(threading.current_thread().name)
        entered.set()
        gate.wait(10)
        return decode(windows, use_decoder)

    pump.decode = held
    return gate, entered, threads


def _snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    err = np.sum((ref.astype(np.float64) - got) ** 2)
    return math.inf if err == 0 else 10 * math.log10(np.sum(ref.astype(np.float64) ** 2) / err)


@pytest.mark.parametrize("use_decoder", [True, False])
@pytest.mark.parametrize("pattern", ["one", "random", "all"])
def test_streamed_audio_matches_offline(chat, use_decoder, pattern):
    tokens = _tokens(chat, 137, use_decoder)
    ref = _offline(chat, tokens, use_decoder)
    for config, floor in ((DEFAULT, 40), (EXACT, 100)):
        wav, _ = _stream(chat, tokens, use_decoder, config, pattern)
        assert wav.dtype == np.float32 and wav.shape == ref.shape
        assert _snr_db(ref, wav) >= floor, (config, _snr_db(ref, wav))


@pytest.mark.parametrize("use_decoder", [True, False])
def test_too_little_context_is_audibly_wrong(chat, use_decoder):
    """The SNR floors above bite: without context the chunk edges are far off the offline audio."""
    tokens = _tokens(chat, 137, use_decoder)
    wav, _ = _stream(chat, tokens, use_decoder, StreamConfig(left_context=2, lookahead=2))
    assert _snr_db(_offline(chat, tokens, use_decoder), wav) < 40


@pytest.mark.parametrize(
    "config",
    [StreamConfig(0, 0), StreamConfig(0, 3), StreamConfig(3, 0), StreamConfig(5, 1, first_chunk=1, chunk=1)],
    ids=["L0R0", "L0R3", "L3R0", "chunk1"],
)
@pytest.mark.parametrize("n", [1, 2, 7, 30, 61])
def test_length_matches_offline_for_any_config(chat, config, n):
    tokens = _tokens(chat, n, use_decoder=False, seed=n)
    wav, _ = _stream(chat, tokens, False, config, "random", seed=n)
    assert wav.shape == ((2 * n - 1) * SAMPLES_PER_TOKEN // 2,)


def test_decode_work_is_linear_in_length():
    c = DEFAULT

    def work(n: int) -> int:
        stream = AudioStream(c)
        for i in range(n):
            stream.push(torch.zeros(1, 4, dtype=torch.long), finished=i == n - 1)
            stream.ready()
        return stream.decoded_tokens

    def bound(n: int) -> float:
        return n * (1 + (c.left_context + c.lookahead) / c.chunk) + c.chunk + c.lookahead

    def quadratic(n: int) -> int:  # today's streaming: re-decode everything so far at every chunk
        return sum(min(end, n) for end in range(c.first_chunk, n + c.chunk, c.chunk))

    for n in (200, 800):
        assert n <= work(n) <= bound(n), (n, work(n), bound(n))
    # the marginal cost per token is the chunk's share of its window, whatever the length
    assert (work(800) - work(200)) * c.chunk <= 600 * (c.chunk + c.left_context + c.lookahead)  # (in integers)
    assert quadratic(800) > 4 * bound(800)


def test_batched_windows_equal_each_stream_alone(chat, monkeypatch):
    """Streams advance in lockstep (same push sizes), so their windows come due together; different lengths
    and one different first chunk make several window lengths per step."""
    lengths, firsts = (90, 41, 5, 128), (8, 8, 8, 13)
    inputs = [_tokens(chat, n, use_decoder=True, seed=i) for i, n in enumerate(lengths)]
    streams = [AudioStream(StreamConfig(first_chunk=f, chunk=20)) for f in firsts]
    alone = [_stream(chat, x, True, s.config)[0] for x, s in zip(inputs, streams, strict=True)]
    calls, to_wavs = [], chat.audio.to_wavs_stacked

    def counting_to_wavs(batch, *args, **kwargs):
        calls.append(len(batch))
        return to_wavs(batch, *args, **kwargs)

    monkeypatch.setattr(chat.audio, "to_wavs_stacked", counting_to_wavs)
    outs, at, step = [[] for _ in streams], 0, 0
    while not all(s.done for s in streams):
        size, windows = 1 + (step * 7) % 17, []
        for s, x, n in zip(streams, inputs, lengths, strict=True):
            if not s.done:
                s.push(x[at : at + size], finished=at + size >= n)
            windows += s.ready()
        at, step, n_calls = at + size, step + 1, len(calls)
        for w, wav in zip(windows, decode_windows(chat.audio, windows, True), strict=True):
            outs[streams.index(w.stream)].append(w.stream.accept(w, wav))
        assert len(calls) - n_calls == len({w.tokens.shape[0] for w in windows})
    assert max(calls) > 1  # some calls did batch windows of several streams
    for got, want in zip(outs, alone, strict=True):
        np.testing.assert_allclose(np.concatenate(got), want, rtol=0, atol=1e-5)


def test_first_audio_after_first_chunk_plus_lookahead():
    stream = AudioStream(StreamConfig(first_chunk=8, lookahead=8))
    for _ in range(15):
        stream.push(torch.zeros(1, 4, dtype=torch.long))
        assert stream.ready() == []
    stream.push(torch.zeros(1, 4, dtype=torch.long))
    (window,) = stream.ready()
    assert (window.start, window.end, window.ctx_start, window.ctx_end) == (0, 8, 0, 16)
    assert not window.final and window.tokens.shape == (16, 4)


def test_stream_finishing_without_tokens_emits_nothing():
    stream = AudioStream()
    stream.push(torch.zeros(0, 4, dtype=torch.long), finished=True)
    assert stream.ready() == [] and stream.done and stream.decoded_tokens == 0


@pytest.mark.parametrize("n", [1, 3, 7])
def test_stream_shorter_than_first_chunk_is_one_final_window(chat, n):
    tokens = _tokens(chat, n, use_decoder=True)
    stream = AudioStream()
    stream.push(tokens)
    assert stream.ready() == []
    stream.push(tokens[:0], finished=True)  # finished pushed with no new tokens
    (window,) = stream.ready()
    assert window.final and (window.start, window.end) == (0, n)
    wav = stream.accept(window, decode_windows(chat.audio, [window], True)[0])
    np.testing.assert_allclose(wav, _offline(chat, tokens, True), rtol=0, atol=1e-6)
    assert stream.done


def test_push_errors():
    stream = AudioStream()
    for bad in (torch.zeros(4), torch.zeros(1, 2, 4), torch.zeros(3, 0), np.zeros((3, 4))):
        with pytest.raises(ValueError, match="2-D tensor"):
            stream.push(bad)
    stream.push(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[n, 4\] torch.int64"):
        stream.push(torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[n, 4\] torch.int64"):
        stream.push(torch.zeros(3, 4))
    # an empty push adds nothing, so its dtype/device do not matter (an engine report with no new tokens; seen on
    # the GPU as a [0, H] CPU tensor after CUDA pushes, which failed a server request mid-stream)
    stream.push(torch.zeros(0, 4))
    stream.push(torch.zeros(0, 4, dtype=torch.long), finished=True)
    with pytest.raises(ValueError, match="push after finished"):
        stream.push(torch.zeros(1, 4, dtype=torch.long))


def test_accept_errors():
    streams = [AudioStream(StreamConfig(first_chunk=2, chunk=2, lookahead=0)) for _ in range(2)]
    for s in streams:
        s.push(torch.zeros(6, 4, dtype=torch.long), finished=True)
    first, second, third = streams[0].ready()
    good = np.zeros((2 * first.tokens.shape[0] - 1) * 256, np.float32)
    with pytest.raises(ValueError, match="another AudioStream"):
        streams[1].accept(first, good)
    with pytest.raises(ValueError, match="in the order ready"):
        streams[0].accept(second, np.zeros((2 * second.tokens.shape[0] - 1) * 256, np.float32))
    with pytest.raises(ValueError, match=f"{good.size} samples"):
        streams[0].accept(first, good[:-1])
    assert streams[0].accept(first, good).shape == (2 * SAMPLES_PER_TOKEN,)


@pytest.mark.parametrize(
    "field, value",
    [("left_context", -1), ("lookahead", -2), ("first_chunk", 0), ("chunk", 0), ("chunk", 2.0)],
)
def test_stream_config_rejects_out_of_range(field, value):
    with pytest.raises(ValueError, match=f"StreamConfig.{field} must be an int >= "):
        StreamConfig(**{field: value})


def test_chunks_grow_so_playback_never_waits_at_real_time():
    """Each chunk is at most the audio already out: at a generation rate of exactly real time, the tokens of
    the next chunk (plus look-ahead beyond what the previous chunk needed) are generated while the audio
    before it plays."""
    cfg = StreamConfig(left_context=16, lookahead=8, first_chunk=8, chunk=24)
    stream = AudioStream(cfg)
    stream.push(torch.zeros(200, 4, dtype=torch.int64), finished=True)
    sizes = [w.end - w.start for w in stream.ready()]
    assert sizes[:5] == [8, 8, 16, 24, 24] and sum(sizes) == 200
    emitted = np.cumsum(sizes)
    assert all(size <= out for size, out in zip(sizes[1:], emitted[:-1], strict=True))


class _Engine:
    """Enough of an AsyncLLMEngine for hand-fed RequestStreams."""

    def __init__(self):
        self.aborted = []

    def abort(self, rid):
        self.aborted.append(rid)


def _out(rid: str, hidden: torch.Tensor, finished: bool, n: int, error: Exception | None = None):
    from chattts_velocity.engine import FinishReason, RequestOutput

    return RequestOutput(rid, new_token_ids=torch.zeros(hidden.shape[0], 4, dtype=torch.int64),
                         new_hidden_states=hidden, num_generated=n, finished=finished,
                         finish_reason=FinishReason.ERROR if error else None, error=error)


@pytest.mark.parametrize("thread", [False, True], ids=["engine-thread", "pump-thread"])
def test_audio_pump_decodes_every_stream_of_an_engine_step_in_one_round(chat, thread):
    """Outputs handed to six streams in one engine step (one ``wake``) are decoded in one round, whatever
    order the streams were fed in; each feed gets exactly its own samples, then its end. On the pump's own
    thread (``thread``) the same."""
    from chattts_velocity.audio import AudioPump
    from chattts_velocity.engine import RequestStream

    pump, engine = AudioPump(chat.audio, thread=thread), _Engine()
    config = StreamConfig(first_chunk=8, lookahead=8)
    tokens = [_tokens(chat, 40, True, seed=i) for i in range(6)]
    want = [_at_once(chat, t, config) for t in tokens]
    streams = [RequestStream(engine, [f"r{i}"]) for i in range(6)]
    feeds = [pump.open(s, config, use_decoder=True) for s in streams]  # nothing to decode yet
    for i in (3, 0, 5, 1, 4, 2):  # one engine step, as the pump sees it: outputs, then one wake
        streams[i].deliver(_out(f"r{i}", tokens[i], True, 40), 0.0)
    pump.wake()
    got = []
    for feed in feeds:
        (rid,) = feed.stream.request_ids
        deliveries = list(feed)  # ends once the request's audio is out
        assert deliveries[-1].done == frozenset({rid})
        got.append(np.concatenate([x for d in deliveries for x in d.samples.get(rid, [])]))
    assert pump.num_calls == 1, "the six streams of one engine step should share one decode round"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and np.allclose(g, w, atol=1e-5), i
    assert not pump._feeds, "finished feeds should be forgotten"
    for s in streams:  # the pump marks when each first window's tokens came, then its first audio
        (times,) = s.times.values()
        assert times.audio_ready is not None and times.audio_ready <= times.first_audio


@pytest.mark.parametrize("every_round", [True, False])
def test_a_feed_that_wants_only_audio_is_not_woken_for_outputs_without_it(chat, every_round):
    """``every_round=False`` (what ``Pipeline.feed`` opens): a round that takes outputs but decodes no audio
    for the feed sends nothing (its ``notify`` is not called); those outputs go out with the next delivery,
    so every output arrives, in order, with the same audio as a feed that hears of every round."""
    from chattts_velocity.audio import AudioPump
    from chattts_velocity.audio.pump import PENDING
    from chattts_velocity.engine import RequestStream

    pump, engine = AudioPump(chat.audio, round_interval_s=0.0), _Engine()
    config = StreamConfig(first_chunk=8, lookahead=8, chunk=24)
    tokens = _tokens(chat, 100, True, seed=7)
    stream, notified = RequestStream(engine, ["r"]), []
    feed = pump.open(stream, config, use_decoder=True, notify=lambda: notified.append(1), every_round=every_round)
    reader, deliveries, rounds = iter(feed), [], []
    for at in range(0, 100, 4):  # one output of 4 tokens a round
        stream.deliver(_out("r", tokens[at : at + 4], at + 4 == 100, at + 4), 0.0)
        before = len(notified)
        pump.wake()
        while (item := next(reader, None)) not in (PENDING, None):
            deliveries.append(item)
        rounds.append(len(notified) > before)
    assert next(reader, None) is None, "the feed should have ended"
    outputs = [out for d in deliveries for out in d.outputs]
    assert [out.num_generated for out in outputs] == list(range(4, 101, 4)), "an output was lost or reordered"
    with_audio = [bool(d.samples) for d in deliveries]
    if every_round:
        assert all(rounds) and not all(with_audio)
    else:
        assert not all(rounds) and all(with_audio) and sum(rounds) == len(deliveries)
        assert len(notified) == len(deliveries)  # the end comes with the last delivery's notify
        assert deliveries[-1].done == frozenset({"r"}) and deliveries[-1].outputs[-1].finished
    got = np.concatenate([x for d in deliveries for x in d.samples.get("r", [])])
    want = _at_once(chat, tokens, config)
    assert got.shape == want.shape and np.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("n", [16, 40])
def test_a_requests_last_audio_and_its_end_reach_a_nonblocking_reader_with_one_notify(chat, n):
    """A reader that drains its feed when notified (the engine process's shipper, through ``take_ready``) finds
    a request's last samples and the end of its audio together: one pass ships both, so the client hears the
    end (and may send its next request) without waiting for the reader's next pass."""
    from chattts_velocity.audio.pump import PENDING, take_ready
    from chattts_velocity.engine import RequestStream

    tokens = _tokens(chat, n, True, seed=3)
    stream, passes = RequestStream(_Engine(), ["r"]), []
    audio = chat.pipeline.samples(stream, use_decoder=True, notify=lambda: passes.append(take_ready(audio)))
    assert next(audio) is PENDING  # the feed is open, nothing decoded yet
    stream.deliver(_out("r", tokens, True, n), 0.0)
    chat.pipeline.pump.wake()
    assert passes, "the reader was never notified"
    chunk, ended, failure = passes[-1]
    assert ended and failure is None and chunk is not None and chunk.size > 0, passes
    got = np.concatenate([p[0] for p in passes if p[0] is not None])
    want = _at_once(chat, tokens, chat.pipeline.stream_config)
    assert got.shape == want.shape and np.allclose(got, want, atol=1e-5)


def _held_thread_pump(chat, n: int, seed: int):
    """A pump with a thread of its own whose decodes wait for a gate, and one open request "r" of ``n`` tokens:
    -> (pump, its engine stand-in, gate, entered, decoding threads' names, config, tokens, stream, feed)."""
    from chattts_velocity.audio import AudioPump
    from chattts_velocity.engine import RequestStream

    pump, engine = AudioPump(chat.audio, thread=True), _Engine()
    gate, entered, threads = _hold_decodes(pump)
    config = StreamConfig(first_chunk=8, lookahead=8)
    tokens = _tokens(chat, n, True, seed=seed)
    stream = RequestStream(engine, ["r"])
    return pump, engine, gate, entered, threads, config, tokens, stream, pump.open(stream, config, use_decoder=True)


def test_a_pump_thread_runs_the_rounds_so_wake_returns_at_once(chat, monkeypatch):
    """``AudioPump(thread=True)``: ``wake`` only signals the pump's thread, which runs the round (a wake during
    a round is served right after it, with every output since); the thread ends once idle, and the next wake
    starts another. A failing decode reaches the reader there too."""

    from chattts_velocity.audio import pump as pump_module
    from chattts_velocity.engine import RequestStream

    monkeypatch.setattr(pump_module, "WORKER_IDLE_S", 0.2)
    pump, engine, gate, entered, threads, config, tokens, stream, feed = _held_thread_pump(chat, 60, 5)
    stream.deliver(_out("r", tokens[:20], False, 20), 0.0)
    pump.wake()  # returns while the round waits in its decode
    assert entered.wait(10)
    stream.deliver(_out("r", tokens[20:], True, 60), 0.0)  # the next step's outputs, during the round
    pump.wake()
    gate.set()
    got = np.concatenate([x for d in feed for x in d.samples.get("r", [])])
    assert threads and set(threads) == {"chattts-velocity-audio"}, threads
    want = _at_once(chat, tokens, config)
    assert got.shape == want.shape and np.allclose(got, want, atol=1e-5)
    worker = pump._worker
    assert worker is not None
    worker.join(5)
    assert not worker.is_alive() and pump._worker is None, "an idle pump thread should end"

    def broken(windows, use_decoder):
        raise RuntimeError("decode broke")

    pump.decode = broken
    failing = RequestStream(engine, ["f"])
    feed = pump.open(failing, config, use_decoder=True)
    failing.deliver(_out("f", tokens[:30], True, 30), 0.0)
    pump.wake()
    with pytest.raises(RuntimeError, match="decode broke"):
        list(feed)
    assert pump._worker is not None and pump._worker is not worker


def test_a_hung_audio_round_fails_the_health_check_and_a_dead_pump_thread_is_replaced(chat):
    """A wake's rounds running longer than the stall limit (a decode that hangs on the pump's thread, where the
    engine's own check sees nothing) fail ``AudioPump.check_health`` and the server's health; once they end it
    passes. A pump thread found dead at a wake is replaced, and the rounds go on."""
    import threading
    import time

    from chattts_velocity.engine import RequestStream
    from chattts_velocity.serving.local import LocalClient

    pump, engine, gate, entered, _, config, tokens, stream, feed = _held_thread_pump(chat, 40, 7)
    stream.deliver(_out("r", tokens, True, 40), 0.0)
    pump.check_health(0.0)  # no round yet
    pump.wake()
    assert entered.wait(10)
    time.sleep(0.1)
    with pytest.raises(RuntimeError, match="audio decode round has run for over 0.05 s"):
        pump.check_health(0.05)
    pump.check_health(60.0)
    gate.set()
    got = np.concatenate([x for d in feed for x in d.samples.get("r", [])])
    assert got.shape == _at_once(chat, tokens, config).shape
    deadline = time.monotonic() + 10
    while pump._round_since is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    pump.check_health(0.0)

    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    pump._worker = dead  # as if the pump's thread had died
    again = RequestStream(engine, ["s"])
    feed = pump.open(again, config, use_decoder=True)
    again.deliver(_out("s", tokens, True, 40), 0.0)
    pump.wake()
    assert np.concatenate([x for d in feed for x in d.samples.get("s", [])]).shape == got.shape
    assert pump._worker is not dead

    client = LocalClient(chat)  # the server's health: the engine's, then its pump's
    real = chat.pipeline.pump._round_since
    try:
        chat.pipeline.pump._round_since = time.monotonic() - 3600
        assert "audio decode round" in (client.health() or "")
    finally:
        chat.pipeline.pump._round_since = real
    assert client.health() is None


def test_a_pump_thread_stops_at_exit_after_serving_the_wake_it_has(chat):
    """``stop_thread`` (what the pump module runs at exit for every pump whose thread started): a wake that
    came during the thread's round is still served, then the thread ends, and later wakes run their rounds on
    the waking thread."""
    import threading

    from chattts_velocity.audio import pump as pump_module

    pump, engine, gate, entered, threads, config, tokens, stream, feed = _held_thread_pump(chat, 90, 6)
    stream.deliver(_out("r", tokens[:20], False, 20), 0.0)
    pump.wake()
    assert entered.wait(10)
    worker = pump._worker
    stream.deliver(_out("r", tokens[20:50], False, 50), 0.0)
    pump.wake()  # pending while the round decodes
    assert pump in pump_module._THREADED
    stopper = threading.Thread(target=pump_module._stop_threads)
    stopper.start()
    gate.set()
    stopper.join(10)
    assert not stopper.is_alive() and not worker.is_alive() and pump._worker is None and not pump.thread
    assert not stream.has_outputs(), "the wake pending at the stop should have been served"
    served = len(threads)
    assert served >= 2 and set(threads) == {"chattts-velocity-audio"}, threads
    stream.deliver(_out("r", tokens[50:], True, 90), 0.0)
    pump.wake()  # on this thread now
    assert threads[served:] and set(threads[served:]) == {threading.current_thread().name}, threads
    got = np.concatenate([x for d in feed for x in d.samples.get("r", [])])
    want = _at_once(chat, tokens, config)
    assert got.shape == want.shape and np.allclose(got, want, atol=1e-5)


def test_audio_pump_ends_a_closed_stream_and_reports_a_failed_request(chat):
    import threading

    from chattts_velocity.audio import AudioPump
    from chattts_velocity.engine import RequestError, RequestStream

    pump, engine = AudioPump(chat.audio), _Engine()
    closed = RequestStream(engine, ["a"])
    feed = pump.open(closed, DEFAULT, use_decoder=True)
    closed.deliver(_out("a", _tokens(chat, 4, True), False, 4), 0.0)
    closed.close()  # from another thread, say: the reader's feed ends instead of waiting forever
    assert sum(x.size for d in feed for x in d.samples.get("a", [])) == 0  # 4 tokens: not a window yet
    assert engine.aborted == ["a"]

    failing = RequestStream(engine, ["b"])
    feed = pump.open(failing, DEFAULT, use_decoder=True)
    failing.deliver(_out("b", _tokens(chat, 30, True), False, 30), 0.0)
    failing.deliver(_out("b", _tokens(chat, 0, True), True, 30, error=RuntimeError("device lost")), 0.0)
    pump.wake()
    seen = []
    with pytest.raises(RequestError, match="device lost"):
        for delivery in feed:
            seen += delivery.samples.get("b", [])
    assert seen, "the audio before the failure is delivered first"
    assert not pump._feeds

    gone = RequestStream(engine, ["d"])  # closed (a client left) between its submission and its reader's open
    gone.close()
    read = []
    reader = threading.Thread(target=lambda: read.append(list(pump.open(gone, DEFAULT, use_decoder=True))),
                              daemon=True)
    reader.start()
    reader.join(10)
    assert read == [[]], "the feed of a stream closed before it was opened must end, not wait forever"

    early = RequestStream(engine, ["c"])  # a short request that finished before its reader opened a feed
    early.deliver(_out("c", _tokens(chat, 20, True), True, 20), 0.0)
    assert sum(x.size for d in pump.open(early, DEFAULT, use_decoder=True) for x in d.samples.get("c", [])) > 0


def test_closing_a_stream_never_waits_for_a_round(chat):
    """The server closes a stream from its event loop: that must end the reader's feed at once, not wait for
    (or run) a decode round, which the engine thread may be in the middle of."""
    import threading
    import time

    from chattts_velocity.audio import AudioPump
    from chattts_velocity.engine import RequestStream

    pump, engine = AudioPump(chat.audio), _Engine()
    busy, idle = RequestStream(engine, ["busy"]), RequestStream(engine, ["idle"])
    busy_feed, idle_feed = pump.open(busy, DEFAULT, use_decoder=True), pump.open(idle, DEFAULT, use_decoder=True)
    gate, entered, _ = _hold_decodes(pump)
    busy.deliver(_out("busy", _tokens(chat, 30, True), True, 30), 0.0)
    engine_thread = threading.Thread(target=pump.wake)  # the engine thread's round, held inside its decode
    engine_thread.start()
    assert entered.wait(10)
    start = time.monotonic()
    idle.close()
    took = time.monotonic() - start
    assert list(idle_feed) == []  # ended at once
    gate.set()
    engine_thread.join(10)
    assert took < 1.0, f"close waited {took:.1f} s for the round"
    assert sum(x.size for d in busy_feed for x in d.samples.get("busy", [])) > 0


def test_paced_rounds_hold_later_chunks_but_never_a_first_or_last_one(chat):
    """``round_interval_s``: a round holding only later chunks waits for the interval (the news stays marked for
    the next wake); a request's first chunk and its last are decoded at once; the audio is the same."""
    from chattts_velocity.audio import AudioPump
    from chattts_velocity.audio.pump import PENDING
    from chattts_velocity.engine import RequestStream

    config = StreamConfig(first_chunk=8, lookahead=8)
    tokens = _tokens(chat, 60, True, seed=3)
    want = _at_once(chat, tokens, config)
    # a clock that stands still: the held chunks' listener is never near running dry (deadlines: test_stream_deadlines)
    pump, engine = AudioPump(chat.audio, round_interval_s=3600.0, clock=lambda: 0.0), _Engine()
    stream = RequestStream(engine, ["r"])
    feed = pump.open(stream, config, use_decoder=True, notify=lambda: None)  # a reader that never blocks
    reader = iter(feed)

    def delivered() -> list:
        out = []
        while (item := next(reader, None)) not in (PENDING, None):
            out += item.samples.get("r", [])
        return out

    stream.deliver(_out("r", tokens[:20], False, 20), 0.0)  # the first chunk (8 + 8 look-ahead) is ready
    pump.wake()
    first = delivered()
    assert pump.num_calls == 1 and len(first) == 1
    stream.deliver(_out("r", tokens[20:50], False, 50), 0.0)  # later chunks only: held
    pump.wake()
    assert pump.num_calls == 1 and delivered() == [] and pump._deferred  # looked at again in the next wake
    stream.deliver(_out("r", tokens[50:], True, 60), 0.0)  # the last chunk: decoded at once, with those held
    pump.wake()
    rest = delivered()
    assert pump.num_calls == 2 and rest
    got = np.concatenate(first + rest)
    assert got.shape == want.shape and np.allclose(got, want, atol=1e-5)
    assert not pump._feeds and not pump._marked and not pump._deferred
    with pytest.raises(ValueError, match="round_interval_s"):
        AudioPump(chat.audio, round_interval_s=-1)


@pytest.mark.parametrize(
    "config", [DEFAULT, EXACT, StreamConfig(0, 0), StreamConfig(3, 0), StreamConfig(5, 1, first_chunk=1, chunk=1),
               StreamConfig(4, 2, first_chunk=30, chunk=10)], ids=str)
def test_window_lengths_are_those_of_every_window_but_the_last(config):
    """``StreamConfig.window_lengths`` (the lengths that get CUDA graphs) lists exactly the lengths of the
    windows a long stream decodes before it ends."""
    stream, seen = AudioStream(config), []
    for _ in range(400):
        stream.push(torch.zeros(1, 4, dtype=torch.long))
        seen += [w.tokens.shape[0] for w in stream.ready()]
    assert list(dict.fromkeys(seen)) == list(config.window_lengths())


@pytest.mark.parametrize("pattern", ["one", "random"])
def test_windows_cut_short_by_the_end_take_more_context_to_a_usual_length(pattern):
    """At a stream's end the windows take more left context rather than decode an odd length (which the wav
    decode's CUDA graphs do not take): every window of a stream at least one full window long has one of
    ``window_lengths``; a shorter stream keeps whatever fits."""
    lengths = set(DEFAULT.window_lengths())
    extended = 0
    for n in [*range(48, 140), 301]:
        stream, seen, at = AudioStream(DEFAULT), [], 0
        for size in _pieces(n, pattern, seed=n):
            stream.push(torch.zeros(size, 4, dtype=torch.long))
            at += size
            seen += stream.ready()
        stream.push(torch.zeros(0, 4, dtype=torch.long), finished=True)
        seen += stream.ready()
        assert {w.tokens.shape[0] for w in seen} <= lengths, (n, [w.tokens.shape[0] for w in seen])
        assert seen[-1].final and seen[-1].end == n
        extended += sum(w.start - w.ctx_start > DEFAULT.left_context for w in seen)
    assert extended > 50  # the end's windows did start earlier
    short = AudioStream(DEFAULT)
    short.push(torch.zeros(30, 4, dtype=torch.long), finished=True)
    assert [w.tokens.shape[0] for w in short.ready()] == [16, 24, 24]  # 30 tokens: its end takes 24, no 32


def test_a_paced_round_decodes_only_the_feeds_with_a_first_or_last_chunk(chat):
    """Between full rounds, a request's first chunk is decoded at once without the other feeds' later chunks,
    which wait (still marked) for the next full round; every feed's audio is the same as decoded alone."""
    from chattts_velocity.audio import AudioPump
    from chattts_velocity.audio.pump import PENDING
    from chattts_velocity.engine import RequestStream

    config = StreamConfig(first_chunk=8, lookahead=8)
    pump, engine = AudioPump(chat.audio, round_interval_s=3600.0, clock=lambda: 0.0), _Engine()  # (as above)
    tokens = {rid: _tokens(chat, 60, True, seed=seed) for rid, seed in (("old", 5), ("new", 6))}
    streams = {rid: RequestStream(engine, [rid]) for rid in tokens}
    readers = {rid: iter(pump.open(s, config, use_decoder=True, notify=lambda: None)) for rid, s in streams.items()}
    calls = []
    decode = pump.decode
    pump.decode = lambda windows, use_decoder: (calls.append({w.stream for w in windows}), decode(windows, use_decoder))[1]

    def delivered(rid) -> list:
        out = []
        while (item := next(readers[rid], None)) not in (PENDING, None):
            out += item.samples.get(rid, [])
        return out

    streams["old"].deliver(_out("old", tokens["old"][:20], False, 20), 0.0)
    pump.wake()  # the old request's first chunk: a full round
    old = delivered("old")
    streams["old"].deliver(_out("old", tokens["old"][20:50], False, 50), 0.0)  # later chunks: held
    streams["new"].deliver(_out("new", tokens["new"][:20], False, 20), 0.0)  # a first chunk: urgent
    pump.wake()
    new = delivered("new")
    assert len(calls) == 2 and len(calls[1]) == 1 and len(new) == 1, "the urgent round decoded the new feed alone"
    assert delivered("old") == [] and streams["old"] in pump._deferred  # (looked at again in the next wake)
    pump._last_decode = float("-inf")  # the interval passed: the next round is a full one
    streams["new"].deliver(_out("new", tokens["new"][20:], True, 60), 0.0)
    pump.wake()
    old += delivered("old")
    new += delivered("new")
    streams["old"].deliver(_out("old", tokens["old"][50:], True, 60), 0.0)
    pump.wake()
    old += delivered("old")
    for rid, got in (("old", old), ("new", new)):
        want = _at_once(chat, tokens[rid], config)
        got = np.concatenate(got)
        assert got.shape == want.shape and np.allclose(got, want, atol=1e-5), rid
    assert not pump._feeds and not pump._marked and not pump._deferred


def test_load_chat_puts_the_audio_rounds_on_a_thread_only_where_the_decodes_are_graphs(upstream_ckpt, caplog):
    """``serve``'s audio thread (on by default) on a CPU: the rounds stay between the engine's steps (eager decodes
    on a thread of their own trade the GIL with the engine), the log says so, and the process's GIL switch
    interval is left as it was."""
    import logging
    import sys

    from chattts_velocity.serving.load import load_chat

    before = sys.getswitchinterval()
    with caplog.at_level(logging.INFO, logger="chattts_velocity.serving.load"):
        chat = load_chat(dict(source="custom", custom_path=upstream_ckpt, device="cpu"), warmup=False,
                         audio_round_ms=20, audio_thread=True)
    try:
        assert chat.pipeline.pump.thread is False and chat.pipeline.pump.round_interval_s == pytest.approx(0.02)
        assert "audio decode rounds between the engine's steps on cpu" in caplog.text
        assert sys.getswitchinterval() == before
    finally:
        chat.unload()


def test_load_chat_with_graphed_decodes_runs_the_rounds_on_a_thread_and_shortens_the_gil_switch(monkeypatch):
    """Where the wav decodes are CUDA graphs (faked here: ``Chat`` stands in), the pump runs its rounds on a thread
    of its own and the process's GIL switch interval drops to ``AUDIO_THREAD_SWITCH_S``, never rising above a
    shorter one set before; with the option off, neither happens."""
    import sys
    from types import SimpleNamespace

    import chattts_velocity.serving.load as load_mod

    class FakeChat:
        def __init__(self):
            self.pipeline = SimpleNamespace(pump=SimpleNamespace(thread=False, round_interval_s=0.05))
            self.audio = SimpleNamespace(graphs=object())

        def load(self, **kw):
            self.kw = kw

    monkeypatch.setattr(load_mod, "Chat", FakeChat)
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        off = load_mod.load_chat({"device": "cpu"}, warmup=False, audio_thread=False)
        assert off.pipeline.pump.thread is False and sys.getswitchinterval() == pytest.approx(0.005, rel=0.02)
        on = load_mod.load_chat({"device": "cpu"}, warmup=False, audio_thread=True)
        assert on.pipeline.pump.thread is True
        assert sys.getswitchinterval() == pytest.approx(load_mod.AUDIO_THREAD_SWITCH_S, rel=0.02)
        sys.setswitchinterval(0.0001)
        load_mod.load_chat({"device": "cpu"}, warmup=False, audio_thread=True)
        assert sys.getswitchinterval() == pytest.approx(0.0001, rel=0.02)  # a shorter one stays
    finally:
        sys.setswitchinterval(before)


def test_windows_are_views_of_the_pushes_and_a_decode_call_copies_once(chat, monkeypatch):
    """A round pushes every stream's new tokens and asks it for windows: a window holds views of the pushes it
    spans, never a copy (no torch call per stream on the engine's thread), and ``decode_windows`` copies a
    call's windows into one batch with a single concatenation. The windows are those of pushing everything
    at once, and so are their samples."""
    config = StreamConfig(first_chunk=8, lookahead=8)
    tokens = torch.randn(90, chat.model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    calls = []
    cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: calls.append(1) or cat(*a, **k))
    stream, windows, at, sizes, pushes = AudioStream(config), [], 0, [1, 3, 2, 8, 1, 5], []
    for i in range(40):
        size = min(sizes[i % len(sizes)], 90 - at)
        if size == 0:
            break
        pushed = tokens[at : at + size].clone()
        pushes.append(pushed)
        stream.push(pushed, finished=at + size == 90)
        at += size
        windows += stream.ready()
    assert at == 90 and stream._finished
    assert calls == [], "ready() copied tokens"
    for w in windows:
        assert sum(p.shape[0] for p in w.pieces) == w.length == w.ctx_end - w.ctx_start
        assert all(any(p.untyped_storage().data_ptr() == q.untyped_storage().data_ptr() for q in pushes)
                   for p in w.pieces)
    assert any(len(w.pieces) > 1 for w in windows)
    ref = AudioStream(config)
    ref.push(tokens, finished=True)
    want = ref.ready()
    assert [(w.start, w.end, w.ctx_start, w.ctx_end, w.final) for w in windows] == \
        [(w.start, w.end, w.ctx_start, w.ctx_end, w.final) for w in want]
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(windows, want, strict=True))
    calls.clear()
    got = decode_windows(chat.audio, windows, True)
    lengths = {w.length for w in windows}
    assert len(calls) == len(lengths), (len(calls), lengths)  # one copy per decode call, none per window
    monkeypatch.setattr(torch, "cat", cat)
    for a, b in zip(got, decode_windows(chat.audio, want, True), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
