"""``Admission`` alone (one process, and two fronts over shared counts) and the merge of several fronts' metrics
(``serve --fronts``); the server tests cover them behind HTTP."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from chattts_velocity.server.admission import Admission, Backlog, QueueFullError, forget_front, shared_counts
from chattts_velocity.server.metrics import Metrics


async def in_slot(ticket, got: list, name: str, hold_s: float = 0.0) -> None:
    """A request's body: wait for a slot, note ``name`` once in it, hold it ``hold_s``."""
    async with ticket.slot():
        got.append(name)
        await asyncio.sleep(hold_s)


def test_limits_queue_order_and_early_slots():
    async def main():
        adm = Admission(1, 2)
        a, b, c = adm.admit(), adm.admit(), adm.admit()
        with pytest.raises(QueueFullError):
            adm.admit()
        assert (adm.running, adm.waiting) == (0, 3)
        assert await a.take_if_free()
        assert (adm.running, adm.waiting) == (1, 2)
        order = []
        tasks = [asyncio.create_task(in_slot(t, order, n, 0.01)) for t, n in ((b, "b"), (c, "c"))]
        await asyncio.sleep(0.01)
        assert order == [] and adm.waiting == 2
        a.release()  # the slot goes to b, the longest waiting
        await asyncio.sleep(0)
        d = adm.admit()
        assert not await d.take_if_free()  # c waits for a slot: a newcomer does not jump it
        await asyncio.gather(*tasks)
        assert order == ["b", "c"]
        d.cancel()
        assert (adm.running, adm.waiting) == (0, 0)

    asyncio.run(main())


def test_a_slot_given_back_goes_to_the_woken_waiter_not_a_newcomer():
    async def main():
        adm = Admission(1, 4)
        first = adm.admit()
        assert await first.take_if_free()
        got = []
        task = asyncio.create_task(in_slot(adm.admit(), got, "waiter"))
        await asyncio.sleep(0.01)
        first.release()  # wakes the waiter, which has not run yet ...
        newcomer = adm.admit()
        assert not await newcomer.take_if_free()  # ... and the newcomer does not take its slot meanwhile
        await asyncio.wait_for(task, 1)
        assert got == ["waiter"]
        assert await newcomer.take_if_free()
        newcomer.release()

    asyncio.run(main())


def test_a_waiter_cancelled_after_its_wake_up_passes_it_on():
    async def main():
        adm = Admission(1, 4)
        first = adm.admit()
        assert await first.take_if_free()
        got = []
        b = asyncio.create_task(in_slot(adm.admit(), got, "b"))
        c = asyncio.create_task(in_slot(adm.admit(), got, "c"))
        await asyncio.sleep(0.01)
        first.release()  # wakes b ...
        b.cancel()  # ... which leaves before it runs: c must get the slot
        await asyncio.wait_for(c, 1)
        assert got == ["c"] and (adm.running, adm.waiting) == (0, 0)

    asyncio.run(main())


def test_two_fronts_admit_against_the_same_limits():
    counts = shared_counts(2)

    async def main():
        one, two = Admission(1, 1, counts, 0), Admission(1, 1, counts, 1)
        a = one.admit()
        assert await a.take_if_free()
        b = two.admit()
        assert not await b.take_if_free()  # the one slot is front 0's
        with pytest.raises(QueueFullError):
            one.admit()  # one running + one queued, over both fronts
        assert (one.running, one.waiting, two.running, two.waiting) == (1, 1, 1, 1)
        got = asyncio.Event()

        async def body():
            async with b.slot():
                got.set()

        task = asyncio.create_task(body())
        await asyncio.sleep(0.05)
        assert not got.is_set()
        a.release()  # front 0 gives it back: front 1's queued request finds it by polling
        await asyncio.wait_for(got.wait(), 1)
        await task
        assert (one.running, one.waiting) == (0, 0)

    asyncio.run(main())


def _backlog_in_a_child(backlog, answers) -> None:
    answers.put(backlog())


def test_the_engine_process_sees_a_full_servers_queue():
    """``Backlog`` over the fronts' shared counts: true only while every running slot is taken and a request
    waits, also in a process it was handed to at spawn (as the engine process gets it)."""
    import multiprocessing as mp

    counts = shared_counts(2)
    backlog = Backlog(counts, 2)

    async def main():
        one, two = Admission(2, 4, counts, 0), Admission(2, 4, counts, 1)
        first = one.admit()
        assert not backlog() and not one.backlogged  # queued, a slot free: no backlog
        assert await first.take_if_free()
        assert await two.admit().take_if_free()
        waiting = one.admit()
        assert not await waiting.take_if_free()
        assert backlog() and one.backlogged and two.backlogged  # both slots taken, one request waits
        ctx = mp.get_context("spawn")
        answers = ctx.Queue()
        child = ctx.Process(target=_backlog_in_a_child, args=(backlog, answers))
        child.start()
        assert answers.get(timeout=60) is True
        child.join(30)
        waiting.cancel()
        assert not backlog() and not one.backlogged

    asyncio.run(main())


def test_a_dead_fronts_counts_are_forgotten():
    counts = shared_counts(2)

    async def main():
        one, two = Admission(1, 0, counts, 0), Admission(1, 0, counts, 1)
        assert await two.admit().take_if_free()  # front 1 then dies holding it
        with pytest.raises(QueueFullError):
            one.admit()
        forget_front(counts, 1)
        assert await one.admit().take_if_free()

    asyncio.run(main())


def _stats():
    from types import SimpleNamespace

    return SimpleNamespace(num_waiting=0, num_running=2, kv_blocks_used=3, kv_blocks_total=10, num_preemptions=0,
                           num_generated_tokens=5, thread_time={"idle": 1.5, "step": 2.0})


def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics_add_the_other_fronts_request_series():
    mine, other = Metrics(Admission(4, 4)), Metrics(Admission(4, 4))
    for m, codes in ((mine, (200, 200, 400)), (other, (200, 429))):
        for code in codes:
            m.count("/v1/audio/speech", code)
    mine.first_audio(0.03)
    other.first_audio(0.2)
    other.first_audio(0.02)
    alone = _samples(mine.render(_stats())[0].decode())
    merged = _samples(mine.render(_stats(), [pickle.loads(pickle.dumps(other.own()))])[0].decode())  # as it crosses the pipe
    route = 'route="/v1/audio/speech"'
    assert merged[f'chattts_requests_total{{{route},status="200"}}'] == 3
    assert merged[f'chattts_requests_total{{{route},status="400"}}'] == 1
    assert merged[f'chattts_requests_total{{{route},status="429"}}'] == 1  # only the other front saw one
    assert alone[f'chattts_requests_total{{{route},status="200"}}'] == 2
    assert merged["chattts_time_to_first_audio_seconds_count"] == 3
    assert merged['chattts_time_to_first_audio_seconds_bucket{le="0.025"}'] == 1
    assert merged['chattts_time_to_first_audio_seconds_bucket{le="0.05"}'] == 2
    assert merged["chattts_time_to_first_audio_seconds_sum"] == pytest.approx(0.25)
    assert merged["chattts_engine_running"] == 2 and merged["chattts_kv_blocks_used"] == 3  # gauges: not summed
    assert {f.type for f in other.own()} == {"counter", "histogram"}
    # the engine thread's counters are the one engine's, whichever front renders them: not summed either
    assert merged['chattts_engine_thread_seconds_total{part="step"}'] == alone['chattts_engine_thread_seconds_total{part="step"}'] == 2.0
    assert "chattts_engine_thread_seconds" not in {f.name for f in mine.own()}
