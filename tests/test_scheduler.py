"""Scheduler: FCFS admission, token budget and chunked prefill, sequence limit, preemption victims and order."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import make_seq

from chattts_velocity.engine.block_manager import BlockSpaceManager
from chattts_velocity.engine.engine_config import EngineConfig
from chattts_velocity.engine.sampling_params import Mode
from chattts_velocity.engine.scheduler import Scheduler
from chattts_velocity.engine.sequence import FinishReason, SequenceStatus


def make(num_blocks=16, block_size=4, max_num_seqs=8, max_tokens=64, watermark=0.0):
    bm = BlockSpaceManager(num_blocks, block_size, watermark)
    return Scheduler(bm, max_num_seqs, max_tokens), bm


def run_step(sched: Scheduler, new_token: int = 7):
    """Schedule, then do what the engine does after the model: mark computed, sample a token where due (a
    decode window: ``num_steps`` of each)."""
    out = sched.schedule()
    for item in out.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += out.num_steps if out.num_steps > 1 else item.num_new_tokens
        sched.block_manager.cache_full_blocks(item.seq)
        if samples:
            item.seq.extend([(new_token,) * 4] * out.num_steps)
    return out


def plan(out):
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def test_fcfs_prefill_then_decode_of_all():
    sched, bm = make()
    a, b = make_seq(5, request_id="a"), make_seq(3, first=50, request_id="b")
    sched.add(a)
    sched.add(b)
    assert plan(run_step(sched)) == [("a", 5), ("b", 3)]
    assert a.block_table == [0, 1] and b.block_table == [2]
    assert plan(run_step(sched)) == [("a", 1), ("b", 1)]
    assert a.status is SequenceStatus.RUNNING and not sched.waiting


def test_token_budget_chunks_long_prompts_and_mixes_them_with_decodes():
    sched, _ = make(max_tokens=6)
    a = make_seq(3, request_id="a")
    long = make_seq(10, first=100, request_id="long")
    sched.add(a)
    assert plan(run_step(sched)) == [("a", 3)]
    sched.add(long)
    out = run_step(sched)
    assert plan(out) == [("a", 1), ("long", 5)]
    assert not out.scheduled[1].samples
    assert long.num_generated == 0 and long.num_computed_tokens == 5
    out = run_step(sched)
    assert plan(out) == [("a", 1), ("long", 5)]
    assert long.num_generated == 1  # the last chunk samples
    assert plan(run_step(sched)) == [("a", 1), ("long", 1)]


def test_max_num_seqs_keeps_the_rest_waiting_in_order():
    sched, _ = make(max_num_seqs=2)
    seqs = [make_seq(2, first=10 * i, request_id=f"s{i}") for i in range(4)]
    for s in seqs:
        sched.add(s)
    assert plan(run_step(sched)) == [("s0", 2), ("s1", 2)]
    assert [s.request_id for s in sched.waiting] == ["s2", "s3"]
    sched.finish(seqs[0], FinishReason.EOS)
    assert plan(run_step(sched)) == [("s1", 1), ("s2", 2)]


def test_watermark_holds_back_admission_but_not_a_lone_request():
    sched, bm = make(num_blocks=10, watermark=0.3)  # 3 blocks reserved
    big = make_seq(30, request_id="big")  # 8 blocks
    sched.add(big)
    assert plan(run_step(sched)) == [("big", 30)]  # nothing running: the watermark does not apply
    small = make_seq(2, first=99, request_id="small")
    sched.add(small)
    assert plan(run_step(sched)) == [("big", 1)]  # 2 free, 3 reserved
    assert list(sched.waiting) == [small]


def test_preemption_takes_the_latest_admitted_and_requeues_it_first():
    sched, bm = make(num_blocks=4, block_size=4)
    a, b = make_seq(4, request_id="a"), make_seq(4, first=50, request_id="b")
    c = make_seq(3, first=90, request_id="c")
    for s in (a, b, c):
        sched.add(s)
    assert plan(run_step(sched)) == [("a", 4), ("b", 4), ("c", 3)]
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2])
    # a and b now need a second block each; a takes the last free one, b preempts c (the latest admitted)
    out = run_step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]
    assert [s.request_id for s in out.preempted] == ["c"]
    assert (a.block_table, b.block_table) == ([0, 3], [1, 2])
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert list(sched.waiting) == [c] and c.num_generated == 1  # its sampled token is kept
    assert plan(run_step(sched)) == [("a", 1), ("b", 1)]  # no room for c
    sched.finish(a, FinishReason.EOS)  # frees 3 then 0
    assert plan(run_step(sched)) == [("b", 1), ("c", 4)]  # prompt + its generated token, recomputed
    assert c.block_table == [3]


def test_an_earlier_sequence_preempts_a_later_one_to_grow():
    sched, bm = make(num_blocks=2, block_size=4)
    a, b = make_seq(4, request_id="a"), make_seq(4, first=50, request_id="b")
    sched.add(a)
    sched.add(b)
    run_step(sched)
    out = run_step(sched)  # a needs a second block: it preempts b and takes b's block
    assert plan(out) == [("a", 1)]
    assert [s.request_id for s in out.preempted] == ["b"]
    assert a.block_table == [0, 1]


def test_preempted_sequence_recomputes_from_its_cached_prefix():
    sched, bm = make(num_blocks=4, block_size=4)
    a, b = make_seq(9, request_id="a"), make_seq(3, first=50, request_id="b")
    sched.add(a)
    sched.add(b)
    assert plan(run_step(sched)) == [("a", 9), ("b", 3)]  # a: blocks 0-2, b: block 3
    assert plan(run_step(sched)) == [("a", 1), ("b", 1)]  # b's block 3 is now full and cached
    out = run_step(sched)  # b needs a second block: none free, b is the latest, it preempts itself
    assert plan(out) == [("a", 1)] and out.preempted == [b]
    sched.finish(a, FinishReason.EOS)
    out = run_step(sched)
    assert plan(out) == [("b", 1)]  # 4 of its 5 tokens come from the cached block
    assert b.block_table == [3, 2]


def test_running_sequence_grows_into_blocks_freed_by_a_finished_one():
    sched, bm = make(num_blocks=5, block_size=4)
    a, b = make_seq(8, request_id="a"), make_seq(7, first=50, request_id="b")
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    assert plan(run_step(sched)) == [("a", 1), ("b", 1)]  # a takes block 4, b fills block 3
    sched.finish(a, FinishReason.EOS)  # frees 4, 1, 0
    assert plan(run_step(sched)) == [("b", 1)]
    assert b.block_table == [2, 3, 4]


def test_abort_of_waiting_and_running_frees_everything():
    sched, bm = make()
    a, b = make_seq(5, request_id="a"), make_seq(5, first=40, request_id="b")
    sched.add(a)
    run_step(sched)
    sched.add(b)
    sched.finish(b, FinishReason.ABORT)
    sched.finish(a, FinishReason.ABORT)
    assert not sched.has_unfinished()
    assert a.finish_reason is FinishReason.ABORT and a.is_finished
    assert bm.num_free_blocks == bm.num_blocks


def test_output_hidden_with_nothing_new_is_empty_like_the_chunks():
    """A report with no new tokens gives [0, H] hidden states of the chunks' dtype and device (a CPU float32
    empty tensor after float16 CUDA chunks failed a streaming request on the GPU)."""
    seq = make_seq(3)
    seq.params = dataclasses.replace(seq.params, return_hidden_states=True)
    assert tuple(seq.output_hidden(8).shape) == (0, 8)
    seq.extend([(7,) * 4, (8,) * 4])
    seq.hidden_chunks.append(torch.randn(2, 8, dtype=torch.float16))
    assert seq.output_hidden(8, 0).dtype == torch.float16 and seq.output_hidden(8, 0).shape == (2, 8)
    empty = seq.output_hidden(8, 2)
    assert empty.shape == (0, 8) and empty.dtype == torch.float16


def test_mixed_audio_and_text_decodes_take_turns_in_windows():
    """Decodes of audio and refine (text) sequences together: each step keeps one mode, in turn, and runs it
    as a window; a step that still prefills stays one mixed step."""
    bm = BlockSpaceManager(64, 4, 0.0)
    sched = Scheduler(bm, 8, 64, num_decode_steps=8)
    audio = [make_seq(5, request_id=f"a{i}") for i in range(2)]
    text = make_seq(6, first=30, request_id="t")
    text.params = dataclasses.replace(text.params, mode=Mode.TEXT)
    for seq in (*audio, text):
        sched.add(seq)
    first = run_step(sched)  # the prefills: one step of all three
    assert plan(first) == [("a0", 5), ("a1", 5), ("t", 6)] and first.num_steps == 1
    turns = []
    for _ in range(4):
        out = run_step(sched)
        turns.append((sorted(s.seq.request_id for s in out.scheduled), out.num_steps))
    assert turns == [(["t"], 8), (["a0", "a1"], 8), (["t"], 8), (["a0", "a1"], 8)]
    assert all(len(seq.block_table) == bm.blocks_for(len(seq)) for seq in (*audio, text))


def test_max_window_tokens_shortens_the_windows_of_large_batches():
    """While requests come in, steps x sequences stays within max_window_tokens (never fewer than
    MIN_CAPPED_STEPS steps, never more than num_decode_steps); without the cap every batch runs
    num_decode_steps, and so does a window that no arrival waits for."""

    def window_after_prefill(batch: int, cap):
        bm = BlockSpaceManager(4096, 4, 0.0)
        sched = Scheduler(bm, 64, 4096, num_decode_steps=32, max_window_tokens=cap)
        for i in range(batch):
            sched.add(make_seq(5, request_id=f"r{i}", max_new=200))
        run_step(sched)  # the prefills
        out = sched.schedule()
        assert len(out.scheduled) == batch
        return out.num_steps

    assert [window_after_prefill(n, None) for n in (1, 8, 40)] == [32, 32, 32]
    assert [window_after_prefill(n, 256) for n in (1, 8, 16, 40, 64)] == [32, 32, 16, 8, 8]  # 6 and 4: floored
    sched = Scheduler(BlockSpaceManager(16, 4, 0.0), 8, 64, num_decode_steps=32, max_window_tokens=100)
    sched.add(make_seq(5, request_id="waits"))  # a request waits: every window is capped
    assert [sched.window_steps(n) for n in (1, 3, 4, 12, 13, 1000)] == [32, 32, 25, 8, 8, 8]
    sched.waiting.clear()  # (admitted since): it came after the last window was scheduled, so still capped
    assert sched.window_steps(40) == 8
    sched = Scheduler(BlockSpaceManager(16, 4, 0.0), 8, 64, num_decode_steps=4, max_window_tokens=100)
    sched.add(make_seq(5, request_id="waits"))
    assert [sched.window_steps(n) for n in (1, 50, 1000)] == [4, 4, 4]  # the floor never lengthens a window

    # a batch that runs on with nobody arriving: its windows run whole after the first; one that arrives caps
    # the next window of the batch (after its prompt step), then the windows run whole again
    bm = BlockSpaceManager(4096, 4, 0.0)
    sched = Scheduler(bm, 64, 4096, num_decode_steps=32, max_window_tokens=256)
    for i in range(40):
        sched.add(make_seq(5, request_id=f"q{i}", max_new=400))
    run_step(sched)  # the prefills
    windows = []
    for turn in range(6):
        if turn == 3:
            sched.add(make_seq(5, request_id="late", max_new=400))
        out = run_step(sched)
        windows.append((len(out.scheduled), out.num_steps))
    assert windows[:3] == [(40, 8), (40, 32), (40, 32)], windows
    assert windows[3:] == [(41, 1), (41, 8), (41, 32)], windows  # its prompt beside one decode step each


def test_a_backlog_outside_the_engine_lifts_the_window_cap():
    """Requests queued for a server's running slots (``Scheduler.backlog``): the windows run whole though
    requests arrive; once the queue is gone the cap is back."""
    sched = Scheduler(BlockSpaceManager(16, 4, 0.0), 8, 64, num_decode_steps=32, max_window_tokens=100)
    sched.add(make_seq(5, request_id="waits"))
    queued = [True]
    sched.backlog = lambda: queued[0]
    assert [sched.window_steps(n) for n in (1, 4, 13, 1000)] == [32, 32, 32, 32]
    queued[0] = False
    assert [sched.window_steps(n) for n in (1, 4, 13, 1000)] == [32, 25, 8, 8]
    sched.backlog = None
    assert sched.window_steps(13) == 8
    sched = Scheduler(BlockSpaceManager(16, 4, 0.0), 8, 64, num_decode_steps=32)
    sched.backlog = lambda: True
    assert sched.window_steps(13) == 32  # no cap, nothing to lift


def test_continue_window_reserves_the_next_window_only_when_the_batch_cannot_change():
    """The scheduler owns the pipelined window's reservation too: the next window's blocks are taken past the
    running window's tokens, and nothing is reserved when a request waits, the running window is a short
    one, or a sequence would reach its length limit inside it."""
    bm = BlockSpaceManager(64, 4, 0.0)
    sched = Scheduler(bm, 8, 64, num_decode_steps=4)
    seqs = [make_seq(5, request_id=f"c{i}", max_new=20) for i in range(2)]
    for seq in seqs:
        sched.add(seq)
    run_step(sched)  # prefill: 6 tokens each
    out = sched.schedule()
    assert out.num_steps == 4 and all(len(s.block_table) == bm.blocks_for(10) for s in seqs)
    free = bm.num_free_blocks
    assert sched.continue_window(seqs, 2) == 0  # a short running window: report it first
    assert sched.continue_window(seqs, 4) == 4
    assert all(len(s.block_table) == bm.blocks_for(6 + 8) for s in seqs) and bm.num_free_blocks == free - 2
    late = make_seq(5, request_id="late")
    sched.add(late)
    assert sched.continue_window(seqs, 4) == 0  # somebody waits: the batch changes after this window
    sched.waiting.clear()
    assert sched.continue_window(seqs[:1], 4) == 0  # not the running batch
    seqs[0].max_tokens = len(seqs[0]) + 4
    assert sched.continue_window(seqs, 4) == 0  # it reaches its limit inside the running window
    seqs[0].max_tokens = len(seqs[0]) + 6
    assert sched.continue_window(seqs, 4) == 4  # room for 2 more: the next window is as long as the longest


def test_window_stops_end_a_young_streams_windows_at_its_first_chunks():
    """``window_stops``: a batch whose youngest audio sequence is short of the last stop runs a window that ends
    at that sequence's next stop (a stream's first audio, then its second chunk), then full windows; a text
    sequence has no stops; the pipelined next window is not queued while the youngest is short of a stop after
    the running window."""
    def windows(stops: tuple[int, ...], late_at: int | None = None, turns: int = 5) -> list[tuple[int, int]]:
        bm = BlockSpaceManager(4096, 4, 0.0)
        sched = Scheduler(bm, 64, 4096, num_decode_steps=32, window_stops=stops)
        for i in range(3):
            sched.add(make_seq(5, request_id=f"r{i}", max_new=400))
        out = []
        for turn in range(turns):
            if turn == late_at:
                sched.add(make_seq(5, request_id="late", max_new=400))
            step = run_step(sched)
            out.append((len(step.scheduled), step.num_steps))
        return out

    # the prompt step makes token 1; then windows to 16 and 24 tokens, then full ones
    assert windows((16, 24)) == [(3, 1), (3, 15), (3, 8), (3, 32), (3, 32)]
    assert windows((16,)) == [(3, 1), (3, 15), (3, 32), (3, 32), (3, 32)]
    assert windows(()) == [(3, 1), (3, 32), (3, 32), (3, 32), (3, 32)]
    # one that arrives at 24 tokens: its prompt with a decode step, then windows to its own stops (16, 24),
    # the older ones along with it; only the youngest sets them (the others' stops would cut 14 steps, not 15)
    assert windows((16, 24), late_at=1) == [(3, 1), (4, 1), (4, 15), (4, 8), (4, 32)]
    assert windows((16, 24), late_at=3, turns=7) == [(3, 1), (3, 15), (3, 8), (4, 1), (4, 15), (4, 8), (4, 32)]

    bm = BlockSpaceManager(256, 4, 0.0)
    sched = Scheduler(bm, 8, 64, num_decode_steps=4, window_stops=(16, 24))
    seqs = [make_seq(5, request_id=f"c{i}", max_new=100) for i in range(2)]
    for seq in seqs:
        sched.add(seq)
    run_step(sched)  # the prompts: 1 token generated each
    assert sched.next_stop(seqs) == 15
    assert sched.continue_window(seqs, 4) == 0  # short of 16 after it: that window ends at its stop
    for seq in seqs:
        seq.extend([(7,) * 4] * 19)
        seq.num_computed_tokens = len(seq) - 1
    assert sched.next_stop(seqs) == 4 and sched.next_stop(seqs[:1]) == 4
    assert sched.continue_window(seqs, 4) == 4  # at 24 after it: past the stops, the next window is queued
    text = make_seq(6, first=30, request_id="t")
    text.params = dataclasses.replace(text.params, mode=Mode.TEXT)
    assert sched.next_stop([text]) is None and sched.next_stop([text, *seqs]) == 4


def test_prefill_first_admits_prompts_in_steps_of_their_own_within_the_prefill_limits():
    """With prefill_first a step that can admit waiting requests computes prompts only (the running decodes
    wait), at most max_prefill_seqs sequences and max_prefill_tokens tokens (a chunked prompt goes on first);
    with nobody waiting, everybody decodes together as one window again."""
    bm = BlockSpaceManager(256, 4, 0.0)
    sched = Scheduler(bm, 16, 64, num_decode_steps=4, prefill_first=True, max_prefill_seqs=2,
                      max_prefill_tokens=12)
    running = [make_seq(5, first=10 * i, request_id=f"old{i}") for i in range(3)]
    for seq in running:
        sched.add(seq)
    assert plan(run_step(sched)) == [("old0", 5), ("old1", 5)]  # two sequences a prefill step
    assert plan(run_step(sched)) == [("old2", 5)]  # old0/old1 decode later: a prompt is waiting
    assert sched.schedule().num_steps == 4  # nobody waits: one window of all three
    new = [make_seq(5, first=100, request_id="new0"), make_seq(9, first=200, request_id="new1"),
           make_seq(3, first=300, request_id="new2")]
    for seq in new:
        sched.add(seq)
    out = run_step(sched)
    assert plan(out) == [("new0", 5), ("new1", 7)] and out.num_steps == 1  # 12 tokens: new1 is chunked
    assert not out.scheduled[1].samples
    assert plan(run_step(sched)) == [("new1", 2), ("new2", 3)]  # the chunked prompt first
    out = sched.schedule()
    assert sorted(plan(out)) == sorted((s.request_id, 1) for s in running + new) and out.num_steps == 4
    for item in out.scheduled:  # that window ran
        item.seq.num_computed_tokens += 4
        item.seq.extend([(7,) * 4] * 4)
    long = make_seq(20, first=400, request_id="long")
    sched.add(long)
    assert plan(run_step(sched)) == [("long", 12)]
    assert not sched.waiting
    assert plan(run_step(sched)) == [("long", 8)]  # nobody waits, but its next chunk is still a step of its own
    assert sched.schedule().num_steps == 4


def test_without_prefill_first_new_prompts_join_the_decodes():
    bm = BlockSpaceManager(256, 4, 0.0)
    sched = Scheduler(bm, 16, 64, num_decode_steps=4)
    old = make_seq(5, request_id="old")
    sched.add(old)
    run_step(sched)
    sched.add(make_seq(5, first=100, request_id="new"))
    assert plan(run_step(sched)) == [("old", 1), ("new", 5)]


def test_accept_appends_until_eos_or_the_length_limit_and_finishes_there():
    """``Scheduler.accept``: tokens up to the first EOS (in any codebook) are appended and the sequence ends
    with EOS; past its length limit nothing is appended, and the limit's reason is LENGTH when the request's
    own max_new_tokens was reached, CAPACITY when the context or cache capped it first; every accepted step
    (the EOS step too) counts as computed."""
    eos = 99
    sched, bm = make(num_blocks=32)
    a = make_seq(3, request_id="a", max_new=10)
    sched.add(a)
    run_step(sched)  # prefill + the first sampled token (7, 7, 7, 7)
    length = len(a)
    assert sched.accept(a, [(1,) * 4, (2, 2, eos, 2), (3,) * 4], eos) == 1
    assert a.is_finished and a.finish_reason is FinishReason.EOS and a.tokens[-1] == (1,) * 4
    assert len(a) == length + 1
    assert bm.num_free_blocks == bm.num_blocks  # finished: its blocks are back

    b = make_seq(3, first=40, request_id="b", max_new=4)
    sched.add(b)
    run_step(sched)  # 1 generated, room for 3 more
    assert sched.accept(b, [(5,) * 4] * 3 + [(eos,) * 4], eos) == 3  # the EOS lies past the limit: unseen
    assert b.finish_reason is FinishReason.LENGTH and b.num_generated == 4

    c = make_seq(3, first=80, request_id="c", max_new=50)
    c.max_tokens = 6  # the context (or the KV cache) caps it before its 50 tokens
    sched.add(c)
    run_step(sched)
    assert sched.accept(c, [(6,) * 4] * 5, eos) == 2
    assert c.finish_reason is FinishReason.CAPACITY and len(c) == 6

    d = make_seq(3, first=120, request_id="d", max_new=50)
    sched.add(d)
    run_step(sched)
    computed = d.num_computed_tokens
    assert sched.accept(d, [(6,) * 4] * 4, eos) == 4 and not d.is_finished and d.num_generated == 5
    assert d.num_computed_tokens == computed + 4 and d.num_uncomputed == 1  # the newest token is the next input


def test_engine_config_checks_window_stops():
    assert EngineConfig().window_stops == (16, 24) and EngineConfig(window_stops=()).window_stops == ()
    for bad in ((24, 16), (16, 16), (0, 8), [16, 24], (True,), 16, (8.0,)):
        with pytest.raises(ValueError, match="window_stops must be a tuple of increasing ints >= 1"):
            EngineConfig(window_stops=bad)
    assert EngineConfig(window_stop_budget_ms=None).window_stop_budget_ms is None
    for bad in (-1.0, "50", True):
        with pytest.raises(ValueError, match="window_stop_budget_ms must be a number >= 0 or None"):
            EngineConfig(window_stop_budget_ms=bad)
    assert EngineConfig().window_budget_ms == 300.0 and EngineConfig(window_budget_ms=None).window_budget_ms is None
    for bad in (0, -1.0, "150", True):
        with pytest.raises(ValueError, match="window_budget_ms must be a number > 0 or None"):
            EngineConfig(window_budget_ms=bad)


def test_a_full_window_of_slow_steps_is_cut_to_the_window_budget():
    """``window_budget_s``: a full window runs ``num_decode_steps`` while they fit the budget at the measured
    ``step_s`` (a GPU's steps), fewer where steps are slow (a CPU's), never fewer than two; a later window stop
    is then weighed against the shorter window."""
    bm = BlockSpaceManager(4096, 4, 0.0)
    sched = Scheduler(bm, 64, 4096, num_decode_steps=32, window_stops=(16, 24), window_stop_budget_ms=50.0,
                      window_budget_ms=150.0)
    seqs = [make_seq(5, request_id=f"r{i}", max_new=400) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    run_step(sched)  # the prompts
    assert sched.full_window_steps(len(seqs)) == 32  # nothing measured yet
    assert run_step(sched).num_steps == 15  # the first stop, as without a budget
    sched.step_s = 0.004  # 128 ms for 32 steps: within the budget
    assert sched.full_window_steps(len(seqs)) == 32 and sched.next_stop(seqs) == 8  # a later stop: 128 ms > 50 ms
    sched.step_s = 0.025  # a slow step: 6 fit in 150 ms
    assert sched.full_window_steps(len(seqs)) == 6 and sched.window_steps(3) == 6
    assert sched.next_stop(seqs) == 8  # 6 steps take 150 ms: the second chunk's stop still applies
    assert run_step(sched).num_steps == 6  # the budget ends the window before the stop
    assert sched.next_stop(seqs) == 2 and run_step(sched).num_steps == 2  # then the stop
    assert sched.next_stop(seqs) is None and run_step(sched).num_steps == 6  # past the stops: a budget window
    assert sched.continue_window(seqs, 6) == 6
    sched.step_s = 0.008  # 32 steps would take 256 ms: 18 of them
    assert sched.full_window_steps(len(seqs)) == 18
    sched.step_s = 0.005  # exactly 30 steps fit
    assert sched.full_window_steps(len(seqs)) == 30
    sched.step_s = 0.2  # slower than the budget: two steps, still a window whose step time is measured
    assert sched.full_window_steps(len(seqs)) == 2 and run_step(sched).num_steps == 2
    unbounded = Scheduler(bm, 64, 4096, num_decode_steps=32, window_budget_ms=None)
    unbounded.step_s = 0.2
    assert unbounded.full_window_steps(3) == 32


def test_a_later_window_stop_applies_only_when_a_full_window_would_outlast_the_budget():
    """``window_stop_budget_s``: the first stop always ends the youngest's window; a later one only while a
    full window (``num_decode_steps`` at the measured ``step_s``) would take longer than the budget."""
    bm = BlockSpaceManager(4096, 4, 0.0)
    sched = Scheduler(bm, 64, 4096, num_decode_steps=32, window_stops=(16, 24), window_stop_budget_ms=50.0)
    seqs = [make_seq(5, request_id=f"r{i}", max_new=400) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    run_step(sched)  # the prompts: 1 token each
    sched.step_s = 0.0  # nothing measured yet: the first stop holds all the same
    assert sched.next_stop(seqs) == 15
    assert run_step(sched).num_steps == 15
    sched.step_s = 0.05 / 32  # a full window takes exactly the budget: it runs whole
    assert sched.next_stop(seqs) is None and sched.continue_window(seqs, 32) == 32
    sched.step_s = 0.002  # 64 ms a full window: it ends at the second chunk
    assert sched.next_stop(seqs) == 8
    assert run_step(sched).num_steps == 8
    assert sched.next_stop(seqs) is None and run_step(sched).num_steps == 32  # past the last stop


def test_full_windows_grow_while_the_host_outlasts_them_and_shrink_back():
    """``fit_window``: a window queued behind another ran so long on the device while the host worked so long
    between windows. Once the host takes ``GROW_AT`` times the window, the next full windows cover its work with
    ``FIT_MARGIN`` to spare, growing at most twofold at once up to ``max_decode_steps``; a host a little slower
    than the window changes nothing; with more than the margin to spare they shrink back, never below
    ``num_decode_steps``. A window queued behind a grown one is granted at the base length already (only a
    short first window is reported before more is queued). A batch under half the one the windows grew at runs
    ``num_decode_steps``: the load, and the host's work with it, fell."""
    from chattts_velocity.engine.scheduler import FIT_MARGIN, GROW_AT

    bm = BlockSpaceManager(4096, 4, 0.0)
    sched = Scheduler(bm, 64, 4096, num_decode_steps=8, max_decode_steps=32)
    seqs = [make_seq(5, request_id=f"g{i}", max_new=400) for i in range(2)]
    for seq in seqs:
        sched.add(seq)
    run_step(sched)
    assert sched.full_window_steps(len(seqs)) == 8 and run_step(sched).num_steps == 8
    sched.fit_window(8, 0.008, 0.004, 2)  # the host's 4 ms fit in the 8 ms window
    assert sched.fitted_steps == 8
    sched.fit_window(8, 0.008, 0.011, 2)  # a little slower than the window: below GROW_AT, unchanged
    assert GROW_AT * 0.008 > 0.011 and sched.fitted_steps == 8
    sched.fit_window(8, 0.008, 0.012, 2)  # 12 ms against 8: 15 steps of 1 ms with the margin
    assert sched.fitted_steps == 15 == round(FIT_MARGIN * 12)
    assert run_step(sched).num_steps == 15 and sched.window_steps(2) == 15
    sched.fit_window(15, 0.015, 0.012, 2)  # covered with the margin: stays
    assert sched.fitted_steps == 15
    sched.fit_window(15, 0.015, 0.1, 2)  # far behind: doubled at most, then the cap
    assert sched.fitted_steps == 30
    sched.fit_window(30, 0.030, 0.1, 2)
    assert sched.fitted_steps == 32
    assert sched.continue_window(seqs, 8) == 32  # behind a base-length window: granted the grown one
    assert sched.continue_window(seqs, 7) == 0  # a short window is still reported first
    assert sched.fitted_batch == 2 and sched.window_steps(1) == 32  # half the batch it grew at: still grown
    sched.fitted_batch = 3
    assert sched.window_steps(1) == 8 and sched.window_steps(2) == 32  # under half: the load fell, no growth
    sched.fitted_batch = 2
    sched.fit_window(32, 0.032, 0.016, 2)  # the host keeps up again: 20 steps cover it
    assert sched.fitted_steps == 20
    sched.fit_window(20, 0.020, 0.001, 2)
    assert sched.fitted_steps == 8
    sched.fit_window(8, 0.0, 1.0, 2)  # nothing measured: unchanged
    assert sched.fitted_steps == 8
    fixed = Scheduler(bm, 64, 4096, num_decode_steps=8)  # max_decode_steps None: never grows
    fixed.fit_window(8, 0.008, 1.0, 2)
    assert fixed.fitted_steps == 8


def test_token_buffer_appends_windows_in_bulk_and_reads_rows_or_tuples():
    """A sequence's tokens: built from ``Token``s or an array (copied), appended a window of rows at a time
    (arrays or tuples), read as read-only array views that stay valid as the buffer grows, or as tuples."""
    import numpy as np

    from chattts_velocity.engine.sequence import TokenBuffer

    prompt = np.arange(12, dtype=np.int64).reshape(3, 4)
    buf = TokenBuffer(prompt)
    prompt[0, 0] = -1  # the caller's array stays the caller's
    assert len(buf) == 3 and buf.width == 4 and buf[0] == (0, 1, 2, 3) and buf[-1] == (8, 9, 10, 11)
    early = buf.rows()
    with pytest.raises(ValueError):
        early[0, 0] = 5  # views are read-only
    for k in range(40):  # past the first capacity: the buffer grows
        buf.extend(np.full((3, 4), k, dtype=np.int64))
    buf.extend([(100,) * 4, (101,) * 4])
    buf.extend(np.zeros((0, 4), dtype=np.int64))  # nothing
    assert len(buf) == 3 + 120 + 2
    assert early.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # an old view still reads its rows
    assert buf[3:6] == [(0,) * 4] * 3 and buf[-2:] == [(100,) * 4, (101,) * 4]
    assert buf.rows(-2).tolist() == [[100] * 4, [101] * 4] and buf.rows(3, 4).shape == (1, 4)
    buf[0] = (9, 9, 9, 9)
    assert buf[0] == (9, 9, 9, 9)
    with pytest.raises(ValueError, match=r"\[k, 4\]"):
        buf.extend(np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="non-empty"):
        TokenBuffer([])
    assert TokenBuffer([(1, 2), (3, 4)])[:] == [(1, 2), (3, 4)]


def test_block_keys_are_the_same_from_tuples_or_arrays():
    """A block's prefix-cache key depends on its ids alone, however they are held (a prompt's rows as checked,
    a window's rows as read back, the tuples of old)."""
    import numpy as np

    from chattts_velocity.engine.block_manager import block_key

    rows = np.arange(64, dtype=np.int64).reshape(16, 4)
    as_tuples = [tuple(r) for r in rows.tolist()]
    text = [True] * 8 + [False] * 8
    assert block_key(b"", rows, text, b"spk") == block_key(b"", as_tuples, text, b"spk")
    assert block_key(b"", rows[::1], text, b"spk") == block_key(b"", np.asfortranarray(rows), text, b"spk")
    assert block_key(b"", rows, text, b"spk") != block_key(b"", rows + 1, text, b"spk")


def test_the_engine_finds_each_sequences_eos_for_a_whole_window_at_once():
    """``LLMEngine._eos_rows``: per sequence of a window, the first step whose token holds its mode's EOS (text
    or audio) in any codebook, the window's length where none does; and ``Scheduler.accept`` given that row
    takes what it takes when it finds the EOS itself."""
    from types import SimpleNamespace

    import numpy as np

    from chattts_velocity.engine.llm_engine import LLMEngine

    engine = SimpleNamespace(text_eos_id=7, model_config=SimpleNamespace(eos_code=9))
    seqs = [SimpleNamespace(text_mode=m) for m in (False, True, False, True)]
    tokens = np.ones((4, 5, 4), dtype=np.int64)
    tokens[0, 3, 2] = 9  # audio EOS in one codebook at step 3
    tokens[1, 1] = 7  # text EOS at step 1
    tokens[2, 2, 0] = 7  # a text EOS id in an audio sequence: not its EOS
    tokens[3, 4, 1] = 9  # an audio EOS id in a text sequence: not its EOS
    assert LLMEngine._eos_rows(engine, seqs, tokens) == [3, 1, 5, 5]
    assert LLMEngine._eos_rows(engine, seqs[:1], tokens[:1, :2]) == [2]

    sched, _ = make(num_blocks=32)
    a, b = make_seq(3, request_id="a", max_new=10), make_seq(3, first=40, request_id="b", max_new=10)
    for seq in (a, b):
        sched.add(seq)
    run_step(sched)
    window = np.array([[1] * 4, [2, 2, 99, 2], [3] * 4], dtype=np.int64)
    assert sched.accept(a, window, 99, 1) == sched.accept(b, window, 99) == 1
    assert a.tokens[a.prompt_len:] == b.tokens[b.prompt_len:] == [(7,) * 4, (1,) * 4]  # run_step's, then one
    assert a.finish_reason is b.finish_reason is FinishReason.EOS and a.num_generated == b.num_generated == 2
