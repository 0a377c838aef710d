"""``AsyncLLMEngine``: one background thread steps the engine for many callers (threads and asyncio tasks).
Every request's output equals its solo run; cancellation, explicit aborts, injected step failures and
shutdown leave the other requests intact and the block pool full."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
import types

import pytest
import torch
from test_engine import code_prompt, params, text_prompt

from chattts_velocity.engine import (
    AsyncLLMEngine,
    EngineConfig,
    EngineShutdownError,
    FinishReason,
    LLMEngine,
    Mode,
    RequestError,
)

TEXTS = ["hello there", "a somewhat longer sentence to speak", "你好", "short", "the fox", "one two three"]


def seeded(i: int, n: int = 24, **kw):
    return params(temperature=(0.3,), seed=1000 + i, max_new_tokens=n, min_new_tokens=kw.pop("min_new", 4), **kw)


@pytest.fixture
def make_async(chat):
    engines = []

    def make(**kw) -> AsyncLLMEngine:
        engine = AsyncLLMEngine(LLMEngine.from_model(chat.model, EngineConfig(**kw), "cpu"))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown(drain=False, timeout=30)
        stats = engine.engine.stats()
        assert stats.kv_blocks_used == 0, f"{stats.kv_blocks_used} blocks leaked"
        assert not engine.engine.has_unfinished_requests()


@pytest.fixture
def solo(chat):
    """The final output of one request run alone in a fresh synchronous engine."""
    engine = LLMEngine.from_model(chat.model, EngineConfig(), "cpu")

    def run(prompt, p):
        engine.add_request("solo", prompt, p)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final = out
        return final

    return run


def collect(stream):
    """Concatenate a one-request stream's outputs: (final output, streamed ids, streamed hidden states)."""
    ids, hidden, final = [], [], None
    for out in stream:
        ids.append(out.new_token_ids)
        if out.new_hidden_states is not None:
            hidden.append(out.new_hidden_states)
        final = out
    return final, torch.cat(ids), torch.cat(hidden) if hidden else None


def assert_same(out, ref, what: str) -> None:
    assert out.finish_reason == ref.finish_reason, f"{what}: finish reason"
    assert torch.equal(out.token_ids, ref.token_ids), f"{what}: tokens differ from the solo run"
    if ref.hidden_states is not None:
        assert torch.allclose(out.hidden_states, ref.hidden_states, atol=1e-4), f"{what}: hidden states differ"


def test_threads_share_one_engine_and_get_their_own_results(chat, make_async, solo):
    engine = make_async()
    prompts = [code_prompt(chat, TEXTS[i % len(TEXTS)]) for i in range(12)]
    results: dict[int, tuple] = {}
    barrier = threading.Barrier(len(prompts))

    def worker(i):
        barrier.wait()
        results[i] = collect(engine.add_request(prompts[i], seeded(i)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == len(prompts)
    for i, (final, ids, hidden) in results.items():
        ref = solo(prompts[i], seeded(i))
        assert_same(final, ref, f"thread {i}")
        assert torch.equal(ids, final.token_ids), f"thread {i}: the increments do not add up to the output"
        assert torch.allclose(hidden, final.hidden_states), f"thread {i}: streamed hidden states"
    stats = engine.stats()
    assert stats.engine.max_batch_size > 1, "the threads' requests never ran in one batch"
    assert stats.num_requests == len(prompts)
    times = stats.requests
    assert all(t.queued <= t.first_token <= t.finished for t in times.values())


def test_async_streams_with_random_cancellation(chat, make_async, solo):
    engine = make_async()
    n = 64
    rng = random.Random(0)
    prompts = [code_prompt(chat, TEXTS[i % len(TEXTS)] + f" {i}") for i in range(n)]
    cancel_after = {i: rng.randint(0, 1) for i in rng.sample(range(n), n // 4)}  # outputs seen before cancelling

    async def consume(i):
        finals, seen = [], 0
        async for out in engine.generate(prompts[i], seeded(i, 40, min_new=40)):
            finals.append(out)
            seen += 1
            if i in cancel_after and seen > cancel_after[i]:
                raise asyncio.CancelledError  # as a cancelled task would
        return finals[-1]

    async def main():
        tasks = [asyncio.create_task(consume(i)) for i in range(n)]
        return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = asyncio.run(main())
    for i, outcome in enumerate(outcomes):
        if i in cancel_after:
            assert isinstance(outcome, asyncio.CancelledError), f"request {i}: {outcome!r}"
        else:
            assert_same(outcome, solo(prompts[i], seeded(i, 40, min_new=40)), f"request {i}")
    engine.shutdown(drain=True, timeout=30)  # the cancelled requests' aborts are applied before it stops
    assert engine.engine.stats().kv_blocks_used == 0


def test_cancelling_a_task_aborts_its_request_within_a_step(chat, make_async):
    engine = make_async(num_decode_steps=4)
    started = threading.Event()

    async def consume():
        async for _ in engine.generate(code_prompt(chat, "cancel me"), seeded(0, 200, min_new=200)):
            started.set()

    async def main():
        task = asyncio.create_task(consume())
        while not started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    for _ in range(200):  # the engine thread applies the abort before its next step
        stats = engine.stats()
        if stats.engine.kv_blocks_used == 0:
            break
        threading.Event().wait(0.01)
    assert stats.engine.kv_blocks_used == 0 and stats.engine.num_running == 0
    (times,) = stats.requests.values()
    assert times.finish_reason is FinishReason.ABORT and times.finished is not None


@pytest.mark.parametrize("window", [1, 8])
def test_a_step_failure_fails_only_the_request_it_concerns(chat, make_async, solo, window):
    engine = make_async(num_decode_steps=window)
    runner = engine.engine.runner
    poisoned = "poison"

    def poison(fn):
        def wrapped(step, *args, **kw):  # a plan (``launch``) or the window before (``launch_next``)
            seqs = [getattr(item, "seq", item) for item in getattr(step, "scheduled", getattr(step, "seqs", None))]
            if any(seq.request_id == poisoned and seq.num_generated >= 3 for seq in seqs):
                raise RuntimeError("injected failure")
            return fn(step, *args, **kw)

        return wrapped

    runner.launch = poison(runner.launch)
    runner.launch_next = poison(runner.launch_next)
    ids = [f"r{i}" for i in range(5)] + [poisoned]
    prompts = [code_prompt(chat, TEXTS[i % len(TEXTS)]) for i in range(len(ids))]
    ps = [seeded(i, 30, min_new=10) for i in range(len(ids))]
    stream = engine.add_requests(prompts, ps, request_ids=ids)
    finals, errors = {}, []
    while True:
        try:
            out = next(stream)
        except StopIteration:
            break
        except RequestError as e:
            errors.append(e)
            continue
        if out.finished:
            finals[out.request_id] = out
    assert len(errors) == 1 and poisoned in str(errors[0]) and "injected failure" in str(errors[0].__cause__)
    assert set(finals) == set(ids[:-1])
    for i, rid in enumerate(ids[:-1]):
        assert_same(finals[rid], solo(prompts[i], ps[i]), rid)
    stats = engine.stats().engine
    assert stats.num_failed == 1 and stats.num_preemptions >= len(ids) - 1  # the batch was quarantined once
    # the engine keeps serving after the failure
    final, _, _ = collect(engine.add_request(prompts[0], ps[0]))
    assert_same(final, solo(prompts[0], ps[0]), "after the failure")


def test_explicit_abort_and_stream_close(chat, make_async):
    engine = make_async(num_decode_steps=4)
    stream = engine.add_request(code_prompt(chat, "abort me"), seeded(0, 300, min_new=300), request_id="x")
    first = next(stream)
    engine.abort("x")
    rest = list(stream)
    assert rest[-1].finished and rest[-1].finish_reason is FinishReason.ABORT
    total = first.new_token_ids.shape[0] + sum(o.new_token_ids.shape[0] for o in rest)
    assert total == rest[-1].token_ids.shape[0] < 300
    with engine.add_request(code_prompt(chat, "close me"), seeded(1, 300, min_new=300)) as s:
        next(s)
    engine.shutdown(drain=True, timeout=30)
    assert engine.engine.stats().kv_blocks_used == 0


def test_the_engine_times_its_aborts_and_its_loop(chat, make_async):
    """``stats()`` carries how long each abort waited for the engine thread (asked to blocks freed) and how long
    each loop turn took; an abort waits at most the turn it arrives in, plus the wake-up."""
    engine = make_async(num_decode_steps=4)
    stream = engine.add_request(code_prompt(chat, "abort me"), seeded(0, 300, min_new=300), request_id="t")
    next(stream)
    engine.abort("t")
    list(stream)
    assert engine.wait_idle(30)
    stats = engine.stats().engine
    waits, turns = stats.abort_wait, stats.loop_time
    assert waits.count == 1 and sum(waits.counts) == 1 and 0 < waits.total_s < 30
    assert turns.count >= 2 and sum(turns.counts) == turns.count and turns.total_s > 0
    assert waits.cumulative()[-1] == ("+Inf", 1) and turns.cumulative()[-1] == ("+Inf", turns.count)
    # a snapshot: later turns do not change it
    before = turns.count
    list(engine.add_request(code_prompt(chat, "after"), seeded(1, 8)))
    assert stats.loop_time.count == before < engine.stats().engine.loop_time.count


def test_the_engine_thread_counts_where_its_time_goes(chat, make_async):
    """``stats().engine.thread_time``: the engine thread's seconds by part since it began, a snapshot; its steps
    and their hand-off take time, it idles between requests, and its waits for the device come only from
    ``device.wait_for`` (none on the CPU)."""
    from chattts_velocity.engine.timings import THREAD_PARTS

    engine = make_async(num_decode_steps=4)
    list(engine.add_request(code_prompt(chat, "time me"), seeded(0, 24)))
    assert engine.wait_idle(30)
    first = engine.stats().engine.thread_time
    assert tuple(first) == THREAD_PARTS and first["step"] > 0 and first["deliver"] > 0
    assert first["step_device_wait"] == first["deliver_device_wait"] == 0.0  # the CPU never waits for a device
    time.sleep(0.05)  # idle: no request
    list(engine.add_request(code_prompt(chat, "again"), seeded(1, 24)))
    assert engine.wait_idle(30)
    later = engine.stats().engine.thread_time
    assert later["step"] > first["step"] and later["idle"] >= first["idle"] + 0.04
    later["step"] = -1.0  # a snapshot: changing it changes nothing the engine counts
    assert engine.stats().engine.thread_time["step"] > first["step"]


def test_the_engine_counts_its_prompt_steps_and_windows(chat, make_async):
    """``EngineStats``: every step read is a prompt step or a decode window; a lone 24-token request of (at most)
    4-step windows has one prompt step (its first token) and then windows that add up to its other 23 tokens."""
    engine = make_async(num_decode_steps=4)
    outs = list(engine.add_request(code_prompt(chat, "count me"), seeded(0, 24, min_new=24)))
    assert engine.wait_idle(30) and outs[-1].token_ids.shape[0] == 24
    s = engine.stats().engine
    assert s.num_prompt_steps == 1 and s.num_window_steps == s.num_window_tokens == 23  # one sequence
    assert s.num_windows >= -(-23 // 4) and s.num_steps == s.num_prompt_steps + s.num_windows  # (stops cut more)


def test_device_waits_are_timed_per_thread():
    """``device.wait_for`` adds the time ``synchronize`` took to the calling thread's ``device_wait_s`` only."""
    import threading

    from chattts_velocity.device import device_wait_s, wait_for

    class Slow:
        def synchronize(self):
            time.sleep(0.03)

    seen = {}

    def other():
        seen["before"] = device_wait_s()
        wait_for(Slow())
        seen["after"] = device_wait_s()

    mine = device_wait_s()
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen["after"] - seen["before"] >= 0.03 and device_wait_s() == mine
    wait_for(Slow())
    assert device_wait_s() - mine >= 0.03


def test_the_engine_times_first_tokens_and_first_audio(chat, make_async):
    """``stats()`` splits a request's way to first audio: submitted → first token (every request), first token →
    first audio (a request whose audio was marked, as the audio pump does), and of that the audio's part, from
    its first window's tokens handed over to its first audio; a request that ends without audio is forgotten,
    not timed."""
    engine = make_async(num_decode_steps=4)
    stream = engine.add_request(code_prompt(chat, "heard"), seeded(0, 200, min_new=200), request_id="a")
    first = next(stream)
    time.sleep(0.01)
    stream.mark_audio_ready("a")  # as the pump does for a streamed request: its first window's tokens came
    time.sleep(0.01)
    stream.mark_first_audio("a")  # and its first audio went out
    list(stream)
    list(engine.add_request(code_prompt(chat, "never heard"), seeded(1, 8, min_new=8), request_id="b"))
    assert engine.wait_idle(30) and first.num_generated >= 1
    stats = engine.stats()
    tokens, audio = stats.engine.first_token_wait, stats.engine.first_audio_wait
    times = stats.requests["a"]
    assert tokens.count == 2 and sum(tokens.counts) == 2 and tokens.total_s > 0
    assert audio.count == 1 and audio.total_s == pytest.approx(times.first_audio - times.first_token)
    assert audio.total_s >= 0.02 and not engine._young
    decode = stats.engine.first_decode_wait
    assert decode.count == 1 and decode.total_s == pytest.approx(times.first_audio - times.audio_ready)
    assert 0.01 <= decode.total_s < audio.total_s


def test_first_audio_that_comes_after_the_request_ended_is_timed(chat, make_async, monkeypatch):
    """A pump on a thread of its own may decode a streamed request's first audio after the engine reported the
    request's end: a later step times it. One whose audio never comes is forgotten after a while; one whose
    pump rounds between the steps (they ran before the engine looked), at once."""
    from chattts_velocity.engine import async_engine

    class Listener:  # an audio pump whose rounds lag behind: it marks first audio itself, later
        thread = True  # (``AudioPump.thread``: rounds on a thread of its own)

        def mark(self, stream):
            pass

        def wake(self, hurry=False):
            pass

        def closed(self, stream):
            pass

    engine = make_async(num_decode_steps=4)
    late = engine.add_request(code_prompt(chat, "late"), seeded(0, 200, min_new=200), request_id="late")
    late.listen(Listener())  # (long before its 50th step: its end)
    never = engine.add_request(code_prompt(chat, "never"), seeded(1, 200, min_new=200), request_id="never")
    never.listen(Listener())
    between = engine.add_request(code_prompt(chat, "between"), seeded(4, 200, min_new=200), request_id="between")
    between.listen(type("Between", (Listener,), {"thread": False})())
    list(late), list(never), list(between)
    assert engine.wait_idle(30) and engine.stats().engine.first_audio_wait.count == 0
    assert "between" not in engine._young and {"late", "never"} <= set(engine._young)
    late.mark_first_audio("late")  # the lagging round, after the end
    list(engine.add_request(code_prompt(chat, "next"), seeded(2, 8, min_new=8)))  # steps to look again
    assert engine.wait_idle(30)
    times = engine.stats().requests["late"]
    audio = engine.stats().engine.first_audio_wait
    assert audio.count == 1 and audio.total_s == pytest.approx(times.first_audio - times.first_token)
    assert "never" in engine._young
    monkeypatch.setattr(async_engine, "_LATE_AUDIO_S", 0.0)
    list(engine.add_request(code_prompt(chat, "later"), seeded(3, 8, min_new=8)))
    assert engine.wait_idle(30) and "never" not in engine._young and not engine._late


def test_shutdown_drains_or_aborts(chat, make_async):
    engine = make_async()
    s1 = engine.add_request(code_prompt(chat, "drain me"), seeded(0, 20, min_new=20))
    engine.shutdown(drain=True, timeout=30)
    out, _, _ = collect(s1)
    assert out.finish_reason is FinishReason.LENGTH and out.token_ids.shape[0] == 20
    with pytest.raises(EngineShutdownError):
        engine.add_request(code_prompt(chat, "too late"), seeded(1))

    engine = make_async()
    s2 = engine.add_request(code_prompt(chat, "abort me"), seeded(0, 400, min_new=400))
    engine.shutdown(drain=False, timeout=30)
    assert list(s2)[-1].finish_reason is FinishReason.ABORT


def test_bad_requests_raise_in_the_caller_and_queue_nothing(chat, make_async):
    engine = make_async()
    good, bad = code_prompt(chat, "fine"), code_prompt(chat, "fine")
    with pytest.raises(ValueError, match="request 1: .*top_k"):
        engine.add_requests([good, bad], [seeded(0), seeded(1, top_k=0)])
    assert engine.stats().num_requests == 0
    engine.add_request(good, seeded(0), request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(good, seeded(0), request_id="dup")


def test_text_and_code_requests_mix(chat, make_async, solo):
    engine = make_async()
    p_text = params(Mode.TEXT, repetition_penalty=1.0, max_new_tokens=12, seed=5, return_hidden_states=False)
    s_text = engine.add_request(text_prompt(chat, "refine me"), p_text)
    s_code = engine.add_request(code_prompt(chat, "speak me"), seeded(3))
    assert_same(collect(s_text)[0], solo(text_prompt(chat, "refine me"), p_text), "text")
    assert_same(collect(s_code)[0], solo(code_prompt(chat, "speak me"), seeded(3)), "code")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs /proc")
def test_a_thousand_requests_with_random_cancellation_leave_the_pool_full_and_memory_flat(chat, make_async):
    engine = make_async(num_kv_blocks=64, block_size=8, max_num_seqs=32)
    rng = random.Random(1)
    prompts = [code_prompt(chat, t) for t in TEXTS]

    async def one(i):
        n = 0
        async for _ in engine.generate(prompts[i % len(prompts)], seeded(i, rng.randint(2, 12), min_new=0)):
            n += 1
            if rng.random() < 0.3:
                return "cancelled"
        return "done"

    async def wave(start, count):
        return await asyncio.gather(*(one(i) for i in range(start, start + count)))

    rss = []
    outcomes = []
    for w in range(4):
        outcomes += asyncio.run(wave(w * 250, 250))
        rss.append(rss_bytes())
    assert len(outcomes) == 1000 and 0 < outcomes.count("cancelled") < 1000
    engine.shutdown(drain=True, timeout=60)
    stats = engine.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_waiting == stats.num_running == 0
    growth = rss[-1] - rss[1]
    assert growth < 32 * 2**20, f"memory grew by {growth / 2**20:.1f} MiB over 500 requests"


def stall_steps(engine, monkeypatch) -> threading.Event:
    """Make the engine's steps hang (as in a hung device call) until the returned event is set."""
    release, step = threading.Event(), engine.engine.step

    def stalled_step():
        release.wait(30)
        return step()

    monkeypatch.setattr(engine.engine, "step", stalled_step)
    return release


def test_health_check_reports_a_stalled_step_a_dead_thread_and_shutdown(chat, make_async, monkeypatch, caplog):
    engine = make_async()
    engine.check_health(stall_s=0.05)  # idle: healthy however long ago the last step was
    # the CUDA streams' state in the log (stand-ins with a stream's ``query``): one hung, one done
    engine.device_streams = {"the engine's": types.SimpleNamespace(query=lambda: False),
                             "the wav decode's": types.SimpleNamespace(query=lambda: True)}
    release = stall_steps(engine, monkeypatch)
    stream = engine.add_request(code_prompt(chat, "stall"), seeded(0, 8, min_new=8))
    threading.Event().wait(0.3)
    with caplog.at_level(logging.ERROR, logger="chattts_velocity.engine.async_engine"):
        for _ in range(3):  # a health probe every so often: the stall is logged once, with where it hangs
            with pytest.raises(RuntimeError, match="without finishing a step"):
                engine.check_health(stall_s=0.2)
    stalls = [r.getMessage() for r in caplog.records if "without finishing a step" in r.getMessage()]
    assert len(stalls) == 1, stalls
    assert "in stalled_step" in stalls[0] and "release.wait(30)" in stalls[0], stalls[0]
    assert stalls[0].endswith("\nthe engine's CUDA stream: still running work\nthe wav decode's CUDA stream: idle")
    engine.check_health(stall_s=30)
    release.set()
    assert collect(stream)[0].finish_reason is FinishReason.LENGTH
    engine.check_health(stall_s=0.2)
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.check_health()

    broken = make_async()

    def fail(seq):
        raise RuntimeError("injected outside any step")

    monkeypatch.setattr(broken.engine, "add_sequence", fail)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the engine thread's death is expected
    broken.add_request(code_prompt(chat, "never runs"), seeded(1))
    for _ in range(500):
        if not broken._thread.is_alive():
            break
        threading.Event().wait(0.01)
    with pytest.raises(RuntimeError, match="thread died"):
        broken.check_health()


def test_a_stall_is_logged_with_nobody_asking(chat, make_async, monkeypatch, caplog):
    """The engine's watcher logs a stalled step (once, with where the engine thread waits) without a health
    probe, and ends with the engine thread."""
    engine = make_async()
    engine.watch_s, engine.watch_stall_s = 0.05, 0.2
    release = stall_steps(engine, monkeypatch)
    before = set(threading.enumerate())
    with caplog.at_level(logging.ERROR, logger="chattts_velocity.engine.async_engine"):
        stream = engine.add_request(code_prompt(chat, "stall"), seeded(0, 8, min_new=8))
        threading.Event().wait(0.8)  # the stall, and a dozen of the watcher's turns past it
        stalls = [r.getMessage() for r in caplog.records if "without finishing a step" in r.getMessage()]
    assert len(stalls) == 1 and "in stalled_step" in stalls[0], stalls
    release.set()
    assert collect(stream)[0].finish_reason is FinishReason.LENGTH
    watchers = [t for t in threading.enumerate() if t.name == "chattts-velocity-engine-watch" and t not in before]
    assert len(watchers) == 1
    engine.shutdown()
    for t in watchers:
        t.join(5)
    assert not any(t.is_alive() for t in watchers)
