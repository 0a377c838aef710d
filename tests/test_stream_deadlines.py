"""The audio pump's scheduling against its listeners' deadlines (``audio.deadlines``, ``AudioPump``): a later
chunk decoded before its listener runs dry, whatever the pacing; first audio ahead of a full round's other
windows; full rounds put off while a request waits for its first audio; first audio held until it outlasts
the gap before the next round; the engine's ``hurry`` signal. Fake clocks and a fake decoder for the rules,
the tiny checkpoint for the audio and an end-to-end run on an engine slower than real time."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch
from test_engine import code_prompt, params

from chattts_velocity.audio import AudioPump, AudioStream, StreamConfig, decode_windows
from chattts_velocity.audio.deadlines import (
    BURST,
    BURST_CHUNKS,
    BURST_FACTOR,
    PLAYBACK_GUARD_S,
    RECENT,
    TOKEN_S,
    Pace,
    safe_to_start,
)
from chattts_velocity.audio.pump import PENDING, Feed
from chattts_velocity.constants import SAMPLE_RATE
from chattts_velocity.engine import (
    AsyncLLMEngine,
    EngineConfig,
    FinishReason,
    LLMEngine,
    RequestOutput,
    RequestStream,
)

CONFIG = StreamConfig()  # first chunk 8 tokens, look-ahead 8, chunks 8, 8, 16, 24, ...
FIRST_S = CONFIG.first_chunk * TOKEN_S  # the first chunk's audio


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeDecoder:
    """Enough of an ``AudioDecoder`` for the pump: a window's samples repeat its first token's first value; every
    decode call and every send lands in ``log``."""

    def __init__(self, log: list):
        self.log = log

    def stream(self):
        return contextlib.nullcontext()

    def to_wavs(self, results, use_decoder, tf32=None):
        self.log.append(("decode", sorted(int(r[0, 0]) for r in results)))
        return np.stack([np.full((2 * r.shape[0] - 1) * 256, float(r[0, 0]), np.float32) for r in results])

    def to_wavs_stacked(self, stacked, use_decoder, tf32=None):
        return self.to_wavs(list(stacked), use_decoder, tf32)


class Aborts:
    def abort(self, rid):
        pass


def _out(rid: str, tokens: torch.Tensor, total: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, new_token_ids=torch.zeros(tokens.shape[0], 4, dtype=torch.int64),
                         new_hidden_states=tokens, num_generated=total, finished=finished,
                         finish_reason=FinishReason.LENGTH if finished else None)


class Request:
    """One request's stream and feed on ``pump``, fed by hand: ``give(n)`` hands the pump n more tokens (each
    token's value is its request's ``tag``), ``got()`` the samples delivered since the last call."""

    def __init__(self, pump: AudioPump, rid: str, tag: int, log: list):
        self.rid, self.tag, self.total = rid, tag, 0
        self.stream = RequestStream(Aborts(), [rid])
        self.feed = pump.open(self.stream, CONFIG, use_decoder=True, notify=lambda: log.append(("send", rid)))
        self._reader = iter(self.feed)

    def give(self, n: int, finished: bool = False) -> None:
        self.total += n
        self.stream.deliver(_out(self.rid, torch.full((n, 4), float(self.tag)), self.total, finished), 0.0)

    def got(self) -> list[np.ndarray]:
        out = []
        while (item := next(self._reader, None)) not in (PENDING, None):
            out += item.samples.get(self.rid, [])
        return out


def _pump(clock: Clock, log: list, **kw) -> AudioPump:
    return AudioPump(FakeDecoder(log), clock=clock, **kw)


def test_pace_estimates_the_gap_from_recent_steps_and_rounds_scaled_to_the_feeds():
    pace = Pace()
    assert pace.gap_s(10) == 0.0
    pace.woke(0.0)  # no step before the first wake
    pace.rested(0.01)
    pace.woke(0.05)  # a step of 0.04
    pace.rested(None)  # no feed open: the idle time until the next wake is no step
    pace.woke(5.0)
    assert pace.gap_s(1) == pytest.approx(0.04)
    pace.round_took(0.002, 1, 1)
    pace.round_took(0.030, 64, 64)
    pace.round_took(0.010, 2, 2)  # too few feeds to scale: counts as it is
    assert pace.round_s(64) == pytest.approx(0.030)
    assert pace.round_s(256) == pytest.approx(0.002 + 0.028 * 4), "a round of 4x the feeds costs 4x beyond the fixed"
    assert pace.round_s(1) == pytest.approx(0.010)
    assert pace.gap_s(256) == pytest.approx(0.04 + 0.002 + 0.028 * 4)


@pytest.mark.parametrize("starting", [1, BURST - 1, BURST, 256])
def test_first_audio_is_safe_once_it_outlasts_the_gap_and_the_guard(starting):
    """A burst of new requests must outlast more gaps than a lone one."""
    gap = 0.1
    need = (BURST_FACTOR if starting >= BURST else 1.0) * gap + PLAYBACK_GUARD_S
    assert not safe_to_start(int(need / TOKEN_S), gap, starting)
    assert safe_to_start(int(need / TOKEN_S) + 1, gap, starting)


@pytest.mark.parametrize("starting", [1, BURST - 1, BURST, 256])
def test_first_audio_of_a_burst_holds_its_least_tokens_whatever_the_gap(starting):
    assert safe_to_start(15, 0.0, starting, least_tokens=16) is (starting < BURST), "only a burst has a least"
    assert safe_to_start(16, 0.0, starting, least_tokens=16)
    assert not safe_to_start(16, 1.0, starting, least_tokens=16), "the least does not lift the gap's rule"


def test_pace_knows_a_load_from_its_widest_round_since_it_began():
    pace = Pace()
    assert not pace.knows(1), "nothing measured yet"
    pace.round_took(0.002, 8, 8)
    assert pace.knows(16) and not pace.knows(17)
    pace.round_took(0.09, 256, 256)
    assert pace.knows(512) and pace.knows(1)
    pace.round_took(0.01, 20, open_feeds=600)  # a round that decoded for 20 of 600 open feeds
    assert pace.knows(1200) and not pace.knows(1201)
    for _ in range(RECENT):  # a light load since: the wide round left the recent ones
        pace.round_took(0.002, 8, 8)
    assert pace.knows(1200), "a load served once is known"
    assert pace.round_s(256) == pytest.approx(0.002), "the estimate itself is made of the recent rounds"


def test_stream_config_head_tokens_are_its_first_chunks():
    assert [CONFIG.head_tokens(n) for n in range(5)] == [0, 8, 16, 32, 56]
    assert StreamConfig(first_chunk=4, chunk=12).head_tokens(BURST_CHUNKS) == 8


@pytest.mark.parametrize("known", [False, True])
def test_a_burst_into_an_unmeasured_load_holds_its_first_two_chunks(known):
    """Fast steps: one chunk outlasts the estimate, but a burst larger than any recent round's feeds is held
    until two chunks are decodable (its estimate was made of a smaller load); a measured load is not."""
    clock, log = Clock(), []
    pump = _pump(clock, log)
    if known:
        pump.pace.round_took(0.001, BURST, BURST)
    requests = [Request(pump, f"r{i}", i + 1, log) for i in range(BURST)]
    for t, n in ((0.002, 1), (0.004, 15)):  # 16 tokens: the first chunk (8) decodable
        pump.wake()
        clock.t = t
        for r in requests:
            r.give(n)
    pump.wake()
    first = [sum(x.size for x in r.got()) for r in requests]
    assert first == [8 * 512 if known else 0] * BURST
    clock.t = 0.006
    for r in requests:
        r.give(8)  # 24 tokens: two chunks decodable
    pump.wake()
    second = [sum(x.size for x in r.got()) for r in requests]
    assert second == [8 * 512 if known else 16 * 512] * BURST
    assert all(r.feed.started[r.rid] == (0.004 if known else 0.006) for r in requests)


def test_deadline_is_first_audio_plus_the_audio_sent_since():
    clock, log = Clock(1.0), []
    pump = _pump(clock, log)
    r = Request(pump, "r", 1, log)
    assert r.feed.deadline("r") is None
    r.give(20)  # the first chunk (8 tokens + 8 look-ahead) is decodable
    pump.wake()
    assert sum(x.size for x in r.got()) == 8 * 512
    assert r.feed.deadline("r") == pytest.approx(1.0 + FIRST_S)
    clock.t = 1.1
    r.give(20)  # 40 tokens: the chunks 8-16 and 16-32
    pump.wake()
    assert r.feed.deadline("r") == pytest.approx(1.0 + 32 * TOKEN_S)


@pytest.mark.parametrize("deadlines", [True, False])
def test_a_later_chunk_is_decoded_in_a_paced_round_when_its_listener_would_run_dry(deadlines):
    """Paced rounds hold later chunks, but not past the point where the listener, playing since the first
    chunk, would run dry before a later round could bring them: then they are decoded at once."""
    clock, log = Clock(), []
    pump = _pump(clock, log, round_interval_s=3600.0, deadlines=deadlines)
    r = Request(pump, "r", 1, log)
    r.give(20)
    pump.wake()  # first audio at t=0: 8 tokens, the listener runs dry at FIRST_S
    assert len(r.got()) == 1
    clock.t = 0.01
    r.give(30)  # later chunks ready, the listener far from dry: they wait for the paced full round
    pump.wake()
    assert r.got() == [] and pump.num_calls == 1
    clock.t = 0.13  # a step of 0.12 since: the next round after this one would come too late
    pump.wake()
    later = r.got()
    if deadlines:
        assert later and pump.num_calls == 2, "the due chunks were held"
        assert clock.t < r.feed.deadline("r") - 16 * TOKEN_S, "they came before the listener ran dry"
    else:  # the pump as it was: held for the interval, and the listener runs dry
        assert later == [] and pump.num_calls == 1


def test_a_round_for_a_due_chunk_takes_every_feeds_ready_windows():
    clock, log = Clock(), []
    pump = _pump(clock, log, round_interval_s=3600.0)
    short, long = Request(pump, "short", 1, log), Request(pump, "long", 2, log)
    short.give(20)
    long.give(120)  # first audio with plenty behind it: 104 tokens
    pump.wake()
    assert sum(x.size for x in short.got()) == 8 * 512 and sum(x.size for x in long.got()) == 104 * 512
    clock.t = 0.01
    short.give(30)
    long.give(30)
    pump.wake()
    assert pump.num_calls == 1  # nobody due yet
    clock.t = 0.13
    log.clear()
    pump.wake()  # "short" is due; "long" is not, yet its ready window joins the same call
    assert pump.num_calls == 2
    assert {tag for e in log if e[0] == "decode" for tag in e[1]} == {1, 2}
    assert short.got() and long.got()
    assert pump._last_decode == 0.13, "a due round is a full one: the pacing starts again"


@pytest.mark.parametrize("deadlines", [True, False])
def test_first_audio_goes_out_before_the_other_windows_of_a_full_round(deadlines):
    clock, log = Clock(), []
    pump = _pump(clock, log, deadlines=deadlines)
    old = Request(pump, "old", 1, log)
    old.give(120)
    pump.wake()
    new = Request(pump, "new", 2, log)
    clock.t = 0.01
    old.give(40)
    new.give(20)
    log.clear()
    pump.wake()  # a full round (unpaced): old's later chunks and new's first
    sent_new = log.index(("send", "new"))
    decoded_old = min(i for i, e in enumerate(log) if e[0] == "decode" and 1 in e[1])
    if deadlines:
        assert log[:sent_new] == [("decode", [2])] and decoded_old > sent_new, log
        assert pump.num_calls == 3, "one call for the first audio, one for the rest"
    else:
        assert decoded_old < sent_new and pump.num_calls == 2, log
    assert new.got() and old.got()


def test_hurry_puts_off_a_full_round_but_not_first_audio_or_a_due_chunk():
    clock, log = Clock(), []
    pump = _pump(clock, log)  # unpaced: every round would be a full one
    old = Request(pump, "old", 1, log)
    old.give(120)
    pump.wake()
    old.got()
    new = Request(pump, "new", 2, log)
    clock.t = 0.01
    old.give(40)
    new.give(20)
    pump.wake(hurry=True)  # a request waits for the next step on its way to first audio
    assert len(new.got()) == 1 and old.got() == [], "the full round was not put off"
    assert old.stream in pump._deferred, "looked at again in the next wake"
    clock.t = 0.02
    pump.wake(hurry=False)
    assert old.got()
    clock.t = 2.0  # old's listener is close to running dry: hurry or not, it is served
    old.give(40)
    pump.wake(hurry=True)
    assert old.got()


@pytest.mark.parametrize("safe_start", [True, False])
def test_first_audio_on_a_slow_engine_waits_until_it_outlasts_the_gap(safe_start):
    """Steps of 0.25 s: a first chunk of 8 tokens (0.17 s) would run dry before the next round; it is held
    until the next step's tokens make it last, then goes out with them in one delivery."""
    clock, log = Clock(), []
    pump = _pump(clock, log, safe_start=safe_start)
    r = Request(pump, "r", 1, log)
    for t, n in ((0.25, 1), (0.5, 15)):  # the prefill's token, then the first window: 16 tokens
        pump.wake()
        clock.t = t
        r.give(n)
    pump.wake()
    first = r.got()
    clock.t = 0.75
    r.give(32)  # 48 tokens: 32 decodable
    pump.wake()
    second = r.got()
    if safe_start:
        assert first == [] and sum(x.size for x in second) == 32 * 512
        assert r.feed.started["r"] == 0.75
    else:
        assert sum(x.size for x in first) == 8 * 512 and r.feed.started["r"] == 0.5
        assert 0.75 - 0.5 > FIRST_S, "the listener of the unheld first chunk ran dry"


@pytest.mark.parametrize("arriving", [1, BURST])
def test_a_burst_of_first_audio_waits_for_more_than_a_lone_one(arriving):
    """Steps of 0.1 s: a lone request's first chunk (0.17 s) outlasts the gap; the first chunks of a burst must
    outlast it twice (its first full window and its streams' next chunks are slower than any recent step)."""
    clock, log = Clock(), []
    pump = _pump(clock, log)
    requests = [Request(pump, f"r{i}", i + 1, log) for i in range(arriving)]
    for t, n in ((0.1, 1), (0.2, 15)):
        pump.wake()
        clock.t = t
        for r in requests:
            r.give(n)
    pump.wake()
    sent = [bool(r.got()) for r in requests]
    assert sent == [arriving < BURST] * arriving


def test_first_audio_on_a_fast_engine_and_a_short_request_is_not_held():
    clock, log = Clock(), []
    pump = _pump(clock, log)
    fast = Request(pump, "fast", 1, log)
    for t, n in ((0.002, 1), (0.01, 15)):
        pump.wake()
        clock.t = t
        fast.give(n)
    pump.wake()
    assert sum(x.size for x in fast.got()) == 8 * 512, "held on a fast engine"
    slow_pump = _pump(clock, log)
    short = Request(slow_pump, "short", 1, log)
    for t in (1.0, 2.0):  # slow steps: a long gap
        slow_pump.wake()
        clock.t = t
    short.give(12, finished=True)  # ... but the request is complete: nothing more will come
    slow_pump.wake()
    assert sum(x.size for x in short.got()) == (2 * 12 - 1) * 256


def test_held_first_audio_is_the_same_audio(chat):
    """A first chunk held and sent with the next ones is decoded in the same windows as sent at once: the same
    samples, bit for bit."""
    tokens = torch.randn(60, chat.model.config.hidden_size, generator=torch.Generator().manual_seed(7))
    got = {}
    for safe_start in (True, False):
        clock = Clock()
        pump = AudioPump(chat.audio, clock=clock, safe_start=safe_start)
        stream = RequestStream(Aborts(), ["r"])
        reader = iter(pump.open(stream, CONFIG, use_decoder=True, notify=lambda: None))
        out, at = [], 0
        for t, n in ((0.25, 1), (0.5, 15), (0.75, 32), (1.0, 12)):
            pump.wake()
            clock.t = t
            at += n
            stream.deliver(_out("r", tokens[at - n : at], at, finished=at == 60), 0.0)
        pump.wake()
        while (item := next(reader, None)) not in (PENDING, None):
            out += item.samples.get("r", [])
        got[safe_start] = np.concatenate(out)
    ref = AudioStream(CONFIG)
    ref.push(tokens, finished=True)
    windows = ref.ready()
    want = np.concatenate([ref.accept(w, x) for w, x in zip(windows, decode_windows(chat.audio, windows, True),
                                                             strict=True)])
    assert np.array_equal(got[True], got[False]) and got[True].shape == want.shape


class Listener:
    """A ``RequestStream`` listener that records the ``hurry`` of every wake."""

    def __init__(self):
        self.hurry: list[bool] = []

    def mark(self, stream):
        pass

    def closed(self, stream):
        pass

    def wake(self, hurry: bool = False):
        self.hurry.append(hurry)


def test_the_engine_hurries_the_rounds_while_a_request_is_on_its_way_to_first_audio(chat):
    """The round after a request's prefill is told to hurry (its first window comes next); the rounds after its
    first window are not."""
    engine = AsyncLLMEngine(LLMEngine.from_model(chat.model, EngineConfig(), "cpu"))
    gate, step = threading.Event(), engine.engine.step
    engine.engine.step = lambda: (gate.wait(30), step())[1]  # the first step waits until the listener is there
    try:
        stream = engine.add_request(code_prompt(chat, "hello there"), params(max_new_tokens=40, min_new_tokens=40))
        listener = Listener()
        stream.listen(listener)
        gate.set()
        outs = list(stream)
        assert outs[-1].num_generated == 40
        assert listener.hurry[0] is True and not any(listener.hurry[1:]), listener.hurry
    finally:
        engine.shutdown(drain=False, timeout=30)


def _underrun_s(deliveries: list[tuple[float, int]]) -> float:
    """How late the latest delivery came after the audio before it had played (playback from the first)."""
    t0, played, worst = deliveries[0][0], 0.0, 0.0
    for t, n in deliveries:
        worst = max(worst, t - t0 - played)
        played += n / SAMPLE_RATE
    return worst


def test_streams_on_an_engine_slower_than_the_first_chunk_never_run_dry(chat, monkeypatch):
    """End to end on the tiny checkpoint, on an engine clock of 0.25 s a step (2.7x real time, the first window
    0.5 s after the call): before, the first chunk (0.17 s) ran dry before the next; now the first audio waits
    a step and every listener has audio until the end. Times are the engine's fake clock, so it is exact."""
    clock, llm = Clock(), chat.engine.engine
    step = llm.step

    def slow_step():
        clock.t += 0.25
        return step()

    monkeypatch.setattr(llm, "step", slow_step)
    sends: list[tuple[float, dict]] = []
    send = Feed._send

    def recorded(feed, *items):
        for item in items:
            if hasattr(item, "samples"):
                sends.append((clock.t, {rid: sum(x.size for x in s) for rid, s in item.samples.items()}))
        send(feed, *items)

    monkeypatch.setattr(Feed, "_send", recorded)
    p = chat.InferCodeParams(manual_seed=3, max_new_token=150, min_new_token=150, show_tqdm=False)
    audio, late = {}, {}
    for variant, switches in (("before", dict(deadlines=False, safe_start=False)), ("after", {})):
        monkeypatch.setattr(chat.pipeline, "pump", AudioPump(chat.audio, 0.05, clock=clock, **switches))
        sends.clear()
        chunks = list(chat.pipeline.stream(["one two three", "the quick fox"], p, use_decoder=True))
        audio[variant] = np.concatenate(chunks, axis=1)
        per_rid: dict[str, list[tuple[float, int]]] = {}
        for t, samples in sends:
            for rid, n in samples.items():
                per_rid.setdefault(rid, []).append((t, n))
        assert len(per_rid) == 2 and all(sum(n for _, n in d) == (2 * 150 - 1) * 256 for d in per_rid.values())
        late[variant] = max(_underrun_s(d) for d in per_rid.values())
    assert late["before"] > 0.05, "the scenario must run the old pump dry"
    assert late["after"] <= 1e-9, f"a listener ran dry for {late['after']:.3f} s"
    assert audio["after"].shape == audio["before"].shape
    assert np.allclose(audio["after"], audio["before"], atol=1e-5)
