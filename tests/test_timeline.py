"""The timeline (``chattts_velocity.timeline``): off, traced functions are the functions themselves; on (the
environment variable set when a process starts), a streamed ``infer`` leaves a Chrome trace of the engine's
steps and the audio rounds, bounded by its event cap, and the reader summarises and merges the files."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from chattts_velocity import timeline
from chattts_velocity.timeline import Timeline, load, main, summary, traced


@pytest.mark.skipif(bool(os.environ.get(timeline.ENV)), reason=f"{timeline.ENV} is set for this run")
def test_off_the_traced_function_is_the_function_itself():
    assert timeline.ACTIVE is None

    def f(x):
        return x + 1

    async def g():
        return 2

    assert traced("f")(f) is f and traced("g", lambda a, k, r: {"r": r})(g) is g


def test_spans_are_written_once_as_a_chrome_trace_and_stop_at_the_cap(tmp_path, monkeypatch):
    tl = Timeline(tmp_path / "tl", max_events=3)
    monkeypatch.setattr(timeline, "ACTIVE", tl)

    @traced("work", lambda a, k, r: {"arg": a[0], "result": r})
    def work(x):
        return x * 2

    @traced("bad description", lambda a, k, r: {"n": 1 / 0})
    def other():
        return None

    assert work(3) == 6 and other() is None
    assert not list((tmp_path / "tl").glob("*.json")), "nothing is written before the cap or the exit"
    assert work(4) == 8  # the third span: the cap, so the file is written now
    work(5)  # past the cap: not recorded
    (path,) = (tmp_path / "tl").glob("*.json")
    assert tl.write() == path, "written once"
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["work", "bad description", "work"]
    assert spans[0]["args"] == {"arg": 3, "result": 6} and spans[2]["args"] == {"arg": 4, "result": 8}
    assert "describe failed" in spans[1]["args"]
    assert all(e["dur"] >= 0 and e["pid"] == os.getpid() for e in spans)
    assert spans[0]["ts"] <= spans[1]["ts"] <= spans[2]["ts"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert "MainThread" in names


def test_a_coroutine_is_traced_when_awaited(tmp_path, monkeypatch):
    import asyncio

    tl = Timeline(tmp_path, max_events=10)
    monkeypatch.setattr(timeline, "ACTIVE", tl)

    @traced("async work")
    async def work():
        await asyncio.sleep(0.01)
        return 7

    assert asyncio.run(work()) == 7
    path = tl.write()
    (span,) = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert span["name"] == "async work" and span["dur"] >= 9_000  # microseconds: the await is inside


def test_garbage_collections_are_spans(tmp_path):
    import gc

    tl = Timeline(tmp_path, max_events=10)
    gc.callbacks.append(tl.gc_phase)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(tl.gc_phase)
    spans = [e for e in json.loads(tl.write().read_text())["traceEvents"] if e["ph"] == "X"]
    assert spans and spans[0]["name"] == "gc" and spans[0]["args"]["generation"] == 2


def test_a_collection_inside_the_timelines_own_bookkeeping_does_not_hang_it(tmp_path):
    """Any allocation may start a collection, whose callback runs on the allocating thread: one that starts
    while the thread records a span (holding the timeline's lock) must not wait for that lock (it hung for
    good before), and is left out; a collection outside is still a span."""
    import gc
    import threading

    tl = Timeline(tmp_path, max_events=10)

    class Collecting(list):
        def append(self, item):
            gc.collect()  # as a collection started by the span's own allocation
            super().append(item)

    tl._events = Collecting()
    gc.callbacks.append(tl.gc_phase)
    try:
        thread = threading.Thread(target=tl.add, args=("span", 0.0, 1.0), daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "recording a span hung in the collector's callback"
        tl._events = list(tl._events)
        gc.collect()
    finally:
        gc.callbacks.remove(tl.gc_phase)
    spans = [e for e in json.loads(tl.write().read_text())["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["span", "gc"]


def test_a_bad_event_cap_is_refused():
    with pytest.raises(ValueError, match="max_events"):
        Timeline("unused", max_events=0)


def test_a_streamed_infer_leaves_a_timeline_of_the_engine_and_the_audio_rounds(upstream_ckpt, tmp_path, capsys):
    """A process started with the variable set: the engine's steps, launches and reads, the hand-over, the audio
    rounds with their decodes; the reader sums them per process and merges the files."""
    script = textwrap.dedent(f"""
        from chattts_velocity import Chat
        chat = Chat()
        chat.load(source="custom", custom_path={str(upstream_ckpt)!r}, device="cpu")
        p = chat.InferCodeParams(manual_seed=1, max_new_token=40, min_new_token=40, show_tqdm=False,
                                 spk_emb=chat.sample_random_speaker())
        for texts in (["a timeline of one request"], ["two at once", "and the other one"]):
            chunks = list(chat.infer(texts, skip_refine_text=True, split_text=False, stream=True,
                                     params_infer_code=p))
            assert chunks
        chat.unload()
    """)
    folder = tmp_path / "tl"
    env = dict(os.environ, **{timeline.ENV: str(folder)})
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    events = load(folder)
    names = {e["name"] for e in events if e["ph"] == "X"}
    for name in ("engine step", "launch", "read tokens", "hand over outputs", "audio round", "audio decode",
                 "audio delivery"):
        assert name in names, (name, sorted(names))
    launches = [e["args"] for e in events if e["name"] == "launch" and e.get("args")]
    assert {a["kind"] for a in launches} >= {"prompt step", "decode window"}
    rows = summary(events)
    assert all(count >= 1 and total >= mean > 0 and longest >= mean for _, _, count, total, mean, longest in rows)
    steps = next(row for row in rows if row[1] == "engine step")
    assert steps[2] == sum(1 for e in events if e["name"] == "engine step")
    merged = tmp_path / "all.json"
    assert main([str(folder), "-o", str(merged)]) == 0
    assert "engine step" in capsys.readouterr().out
    assert json.loads(merged.read_text())["traceEvents"] == events
