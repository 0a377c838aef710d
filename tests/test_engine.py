"""The velocity engine against the reference decode (argmax sampling): identical tokens, hidden states within
1e-4, across prompt lengths, per-request params, modes, preemption, chunked prefill and prefix caching; seeded
batch invariance; aborts; bad requests. Every engine built here must end with its whole block pool free."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from engine_helpers import record_windows

from chattts_velocity.engine import EngineConfig, FinishReason, LLMEngine, Mode, Prompt, SamplingParams
from chattts_velocity.reference import DecodeSettings, reference_generate
from chattts_velocity.text import decode_prompt, decorate_code_prompts, decorate_text_prompts, speaker_vector

ARGMAX = 1e-4  # temperature that turns sampling into argmax
HIDDEN_ATOL = 1e-4


@pytest.fixture
def make_engine(chat):
    """Build engines over the tiny checkpoint; after the test every block must be back in the free pool."""
    engines = []

    def make(**kw) -> LLMEngine:
        engine = LLMEngine.from_model(chat.model, EngineConfig(**kw), "cpu")
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        bm = engine.block_manager
        assert not engine.has_unfinished_requests(), "requests left in the engine"
        assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks leaked"
        assert all(b.ref_count == 0 for b in bm.blocks)


def code_prompt(chat, text: str, spk: str | None = None, smp: str | None = None) -> Prompt:
    model = chat.model
    codes = decode_prompt(smp, num_vq=4, num_codes=model.config.num_audio_tokens) if smp else None
    (decorated,) = decorate_code_prompts([text], "[speed_5]", None, spk is not None)
    ids, _, text_mask = model.tokenizer.encode([decorated], 4, prompt=codes)
    vec = speaker_vector(spk, model.config.hidden_size) if spk else None
    return Prompt(ids[0], text_mask[0], vec)


def text_prompt(chat, text: str) -> Prompt:
    (decorated,) = decorate_text_prompts([text], "")
    ids, _, text_mask = chat.model.tokenizer.encode([decorated], 4)
    return Prompt(ids[0], text_mask[0])


def params(mode=Mode.CODE, **kw) -> SamplingParams:
    base = dict(mode=mode, temperature=(ARGMAX,), top_p=0.7, top_k=20, repetition_penalty=1.05,
                max_new_tokens=24, seed=0)
    base.update(kw)
    return SamplingParams(**base)


def reference(chat, prompt: Prompt, p: SamplingParams):
    """The reference loop on this one request: (ids, hidden states)."""
    model = chat.model
    text_mode = p.mode is Mode.TEXT
    settings = DecodeSettings(
        text_mode=text_mode, temperature=p.temperatures(4), top_p=p.top_p, top_k=p.top_k,
        repetition_penalty=p.repetition_penalty, max_new_token=p.max_new_tokens, min_new_token=p.min_new_tokens,
        eos_id=model.tokenizer.eos_token if text_mode else model.config.eos_code, penalty_row_cap=None,
        manual_seed=0, show_tqdm=False,
    )
    mask = torch.ones(1, prompt.ids.size(0), dtype=torch.int64)
    out = list(reference_generate(model.gpt, prompt.ids[None], mask, prompt.text_mask[None], settings,
                                  spk_id=model.tokenizer.spk_emb_ids, spk_vec=prompt.speaker))[-1]
    return out.ids[0], out.hiddens[0]


def run(engine: LLMEngine, prompts, ps) -> dict:
    for i, (prompt, p) in enumerate(zip(prompts, ps, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture
def workload(chat, upstream_chat):
    """Prompts of very different lengths, modes and params, with and without speaker / voice sample."""
    with torch.random.fork_rng():
        torch.manual_seed(3)
        spk = upstream_chat.sample_random_speaker()
    smp_codes = torch.randint(0, 625, (4, 21), generator=torch.Generator().manual_seed(5))
    from chattts_velocity.text import encode_prompt

    smp = encode_prompt(smp_codes)
    long_text = "the quick brown fox jumps over the lazy dog " * 3
    prompts = [
        code_prompt(chat, "hi"),
        code_prompt(chat, long_text, spk=spk),
        code_prompt(chat, "a voice sample follows", spk=spk, smp=smp),
        text_prompt(chat, "refine this sentence please"),
        code_prompt(chat, "medium length sentence here", spk=spk),
        code_prompt(chat, "hi"),  # equal to the first: a full prefix-cache candidate
    ]
    ps = [
        params(min_new_tokens=6, max_new_tokens=30),
        params(top_p=0.9, top_k=5, repetition_penalty=1.3, min_new_tokens=2, max_new_tokens=17),
        params(temperature=(ARGMAX, ARGMAX / 2, ARGMAX, ARGMAX), min_new_tokens=10, max_new_tokens=28),
        params(Mode.TEXT, repetition_penalty=1.0, top_k=None, max_new_tokens=20, return_hidden_states=False),
        params(top_p=None, repetition_penalty=None, min_new_tokens=3, max_new_tokens=33),
        params(min_new_tokens=12, max_new_tokens=12),
    ]
    return prompts, ps


def assert_matches_reference(chat, outs, prompts, ps):
    for i, (out, prompt, p) in enumerate(zip(outs, prompts, ps, strict=True)):
        ids, hidden = reference(chat, prompt, p)
        assert torch.equal(out.token_ids, ids), f"request {i}: tokens differ from the reference"
        if p.return_hidden_states:
            assert out.hidden_states.shape == hidden.shape, f"request {i}: hidden states shape"
            diff = (out.hidden_states - hidden).abs().max().item() if hidden.numel() else 0.0
            assert diff <= HIDDEN_ATOL, f"request {i}: hidden states differ by {diff:.3g}"
        else:
            assert out.hidden_states is None


ENGINE_SETUPS = {
    "default": dict(),
    "preemption": dict(num_kv_blocks=20, block_size=8),
    "chunked-prefill": dict(max_num_batched_tokens=7),
    "no-prefix-cache": dict(enable_prefix_caching=False, block_size=4),
    "prefix-cache-small-blocks": dict(block_size=2, max_num_seqs=2),  # later requests find cached prefixes
    # prompts in steps of their own, 2 sequences and 16 tokens at most (a CUDA engine's are its prefill graph's)
    "prefill-first": dict(prefill_first=True, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("setup", list(ENGINE_SETUPS), ids=list(ENGINE_SETUPS))
def test_engine_equals_reference_under_argmax(chat, make_engine, workload, setup):
    engine = make_engine(**ENGINE_SETUPS[setup])
    steps = []
    if setup == "prefill-first":
        engine.scheduler.max_prefill_seqs = 2
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda: (out := schedule(), steps.append(
            [(item.seq.num_generated, item.num_new_tokens) for item in out.scheduled]))[0]
    prompts, ps = workload
    outs = run(engine, prompts, ps)
    assert_matches_reference(chat, outs, prompts, ps)
    if steps:  # no step mixed prompts with decodes, none over the limits
        prefills = [step for step in steps if any(generated == 0 for generated, _ in step)]
        assert len(prefills) >= 4 and all(len(step) <= 2 and sum(n for _, n in step) <= 16 for step in prefills)
        assert all(generated == 0 or n > 1 for step in prefills for generated, n in step)
    assert all(o.finish_reason in (FinishReason.EOS, FinishReason.LENGTH) for o in outs)
    if setup == "prefix-cache-small-blocks":  # the speaker prompts share [Stts][spk_emb]; r0 and r5 everything
        assert engine.block_manager.num_hit_blocks >= 3
    if not engine.block_manager.enable_prefix_caching:
        assert engine.block_manager.num_hit_blocks == 0


@pytest.mark.parametrize("setup", ["default", "chunked-prefill", "preemption"])
def test_padded_prefill_steps_equal_the_reference(chat, make_engine, workload, setup):
    """The CUDA engine's padded prefill (``PaddedPrefill``: tokens and sequences padded to a bucket, padding
    writing no KV), run eagerly on the CPU: the reference's tokens and hidden states all the same."""
    from chattts_velocity.engine.prefill_graphs import PaddedPrefill

    engine = make_engine(**ENGINE_SETUPS[setup])
    runner = engine.runner
    width = runner.decoder.state.block_tables.size(1)
    calls = []

    class Counted(PaddedPrefill):
        def __call__(self, emb, meta):
            calls.append((emb.size(0), meta.context_lens.size(0)))
            return super().__call__(emb, meta)

    runner.prefill = Counted(runner.core, runner.kv_caches, width, torch.device("cpu"))
    prompts, ps = workload
    outs = run(engine, prompts, ps)
    assert_matches_reference(chat, outs, prompts, ps)
    # every prefill went through the padding, some of several sequences, none filling its bucket exactly
    assert calls and any(s > 1 for _, s in calls) and any(n not in (32, 64, 128) for n, _ in calls)


def test_preemption_happens_with_the_small_cache(chat, make_engine, workload):
    engine = make_engine(**ENGINE_SETUPS["preemption"])
    preempted = []
    original = engine.scheduler._preempt

    def spy(seq):
        preempted.append(seq.request_id)
        original(seq)

    engine.scheduler._preempt = spy
    run(engine, *workload)
    assert preempted, "the small-cache setup must exercise preemption"


def test_prefix_cache_shares_the_speaker_prefix(chat, make_engine, upstream_chat):
    with torch.random.fork_rng():
        torch.manual_seed(4)
        spk = upstream_chat.sample_random_speaker()
        other = upstream_chat.sample_random_speaker()
    engine = make_engine(block_size=2)
    first = code_prompt(chat, "one shared speaker prefix", spk=spk)
    run(engine, [first], [params(max_new_tokens=3)])
    more = "one shared speaker prefix, more"
    same = engine.num_cached_prompt_tokens(code_prompt(chat, more, spk=spk))
    assert same >= 8, "a prompt with the same speaker and text prefix must reuse cached blocks"
    assert engine.num_cached_prompt_tokens(code_prompt(chat, more, spk=other)) == 0, "another speaker shares nothing"
    assert engine.num_cached_prompt_tokens(code_prompt(chat, more)) == 0, "no speaker shares nothing"


def sampled(seed: int, **kw) -> SamplingParams:
    """Real sampling (upstream's default temperature) with a seed."""
    return params(temperature=(0.3,), seed=seed, **kw)


def test_seeded_output_is_batch_invariant(chat, make_engine, workload):
    """One request alone, inside 8 others (before and after it), and under preemption: same tokens, same audio."""
    prompts, _ = workload
    target, p = code_prompt(chat, "the same request every time"), sampled(1234, min_new_tokens=20, max_new_tokens=40)
    others = [prompts[i % len(prompts)] for i in range(8)]
    other_ps = [sampled(100 + i, min_new_tokens=5, max_new_tokens=30 + 3 * i) for i in range(8)]
    other_ps[3] = dataclasses.replace(other_ps[3], mode=Mode.TEXT, temperature=(0.7,),
                                      return_hidden_states=False)  # prompts[3] is the refine prompt
    alone = run(make_engine(), [target], [p])[0]
    first = run(make_engine(), [target, *others], [p, *other_ps])[0]
    last = run(make_engine(), [*others, target], [*other_ps, p])[-1]
    small = make_engine(num_kv_blocks=24, block_size=8)
    preempted = []
    original = small.scheduler._preempt
    small.scheduler._preempt = lambda seq: (preempted.append(seq.request_id), original(seq))
    crowded = run(small, [*others, target], [*other_ps, p])[-1]
    assert preempted, "the small cache must preempt"
    assert alone.num_generated >= 20
    for name, out in (("first in a batch of 9", first), ("last in a batch of 9", last), ("preempted", crowded)):
        assert torch.equal(out.token_ids, alone.token_ids), f"{name}: tokens differ from the request alone"
    wavs = chat.audio.to_wav_list([alone.token_ids, first.token_ids, crowded.token_ids], use_decoder=False)
    assert wavs[0].size > 0 and np.array_equal(wavs[0], wavs[1]) and np.array_equal(wavs[0], wavs[2])


def test_pipelined_decode_windows_match_single_steps(chat, make_engine):
    """Windows queued behind the previous one (before its tokens are read) give the tokens and hidden states
    of one-step scheduling, through EOS endings, length limits and a request arriving mid-run."""
    texts = [f"pipelined request {i}" for i in range(4)]
    ps = [sampled(50 + i, min_new_tokens=3, max_new_tokens=20 + 9 * i) for i in range(4)]
    ps[1] = sampled(51, min_new_tokens=23, max_new_tokens=23)  # ends by its length limit

    def generate(window: int, ahead: bool = False, **kw) -> tuple[list, int, int]:
        engine = make_engine(num_decode_steps=window, pipeline_decode=True, **kw)  # off by default on CPU
        launches, launched_ahead = [], 0
        record_windows(engine, lambda window, continuing: launches.append(continuing))
        for i in range(3):
            engine.add_request(f"r{i}", code_prompt(chat, texts[i]), ps[i])
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            steps += 1
            if steps == 4:  # arrives while a window is in flight
                engine.add_request("r3", code_prompt(chat, texts[3]), ps[3])
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            if ahead:  # as the engine thread does before an audio round
                launched_ahead += engine.launch_ahead()
        return [done[f"r{i}"] for i in range(4)], sum(launches), launched_ahead

    single, _, _ = generate(1)
    piped, continued, _ = generate(4)
    prefill_first, _, _ = generate(4, prefill_first=True)
    ahead, _, launched_ahead = generate(4, ahead=True, prefill_first=True)
    assert continued >= 3, "some windows must have been queued behind the previous one"
    assert launched_ahead >= 2, "the arrival's prompt step and its short first window are launched ahead"
    assert {out.finish_reason for out in single} == {FinishReason.EOS, FinishReason.LENGTH}
    for a, b, c, d in zip(single, piped, prefill_first, ahead, strict=True):
        for other in (b, c, d):
            assert torch.equal(a.token_ids, other.token_ids) and a.finish_reason == other.finish_reason
            torch.testing.assert_close(a.hidden_states, other.hidden_states, atol=1e-5, rtol=1e-5)


def test_pipelined_windows_grow_while_the_host_outlasts_them(chat, make_engine, monkeypatch):
    """Where the host's work between two pipelined windows (a sleep after each step here, as an audio round of
    many streams would take) outlasts a window on the device, the full windows grow up to ``max_decode_steps``;
    where the device is the slower, they stay at ``num_decode_steps``. The tokens are those of fixed windows.
    (The device time is made up: on the CPU a window runs inside its launch.)"""
    from chattts_velocity.engine.model_runner import LaunchedStep

    texts = ["a window grows", "while the host is slow"]
    ps = [sampled(70 + i, min_new_tokens=60, max_new_tokens=60) for i in range(2)]

    def generate(step_device_s: float, host_s: float, max_steps: int | None) -> tuple[list, list[int]]:
        monkeypatch.setattr(LaunchedStep, "device_s", lambda self: step_device_s * self.num_steps)
        engine = make_engine(num_decode_steps=4, max_decode_steps=max_steps, window_stops=(), window_budget_ms=None,
                             pipeline_decode=True)  # no budget: a slow machine's steps would cap the windows
        behind = []
        record_windows(engine, lambda w, continuing: continuing and behind.append(w.num_steps))
        for i, text in enumerate(texts):
            engine.add_request(f"g{i}", code_prompt(chat, text), ps[i])
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            time.sleep(host_s)
        return [done[f"g{i}"] for i in range(2)], behind

    fixed, fixed_windows = generate(0.001, 0.02, 4)
    grown, grown_windows = generate(0.001, 0.02, 16)
    kept, kept_windows = generate(1.0, 0.0, 16)
    assert max(fixed_windows) == 4 and max(kept_windows) == 4
    assert max(grown_windows) == 16 and len(grown_windows) < len(fixed_windows)
    for a, b, c in zip(fixed, grown, kept, strict=True):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.token_ids, c.token_ids)
        torch.testing.assert_close(a.hidden_states, b.hidden_states, atol=1e-5, rtol=1e-5)


def test_a_request_arriving_during_a_window_waits_for_that_window_only(chat, make_engine):
    """With ``LLMEngine.arrivals`` (set by the async engine), the batch's next window is queued only after the
    running one ended and ``arrivals`` found nobody new: a request that arrived during the first window runs its
    prompt step right after it. Without the hook the next window was queued as the first one started, and the
    same arrival (taken at the next step) waits for it too. The tokens are those of one-step scheduling."""
    texts, ps = ["already running", "arrives mid-window"], [sampled(7, min_new_tokens=30, max_new_tokens=30),
                                                             sampled(8, min_new_tokens=6, max_new_tokens=6)]

    def generate(window: int, hook: bool) -> tuple[list, list]:
        engine = make_engine(num_decode_steps=window, window_stops=(), pipeline_decode=window > 1)
        events = []
        record_windows(engine, lambda w, continuing: events.append("queued" if continuing else "window"))
        forward = engine.runner.forward
        engine.runner.forward = lambda scheduled: (events.append("prompt"), forward(scheduled))[1]

        def arrive() -> None:
            engine.add_request("b", code_prompt(chat, texts[1]), ps[1])
            events.append("arrived")

        def arrivals() -> bool:  # called when a window ended, before the next one is queued
            if "arrived" not in events:
                arrive()
                return True
            return False

        engine.arrivals = arrivals if hook else None
        engine.add_request("a", code_prompt(chat, texts[0]), ps[0])
        done = {}
        while engine.has_unfinished_requests():
            if not hook and events.count("window") == 1 and "arrived" not in events:  # the first window ran
                arrive()  # what the async engine hands over at the next step
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        return [done["a"], done["b"]], events

    single, _ = generate(1, hook=False)
    late, events = generate(4, hook=True)
    early, early_events = generate(4, hook=False)
    assert events[:4] == ["prompt", "window", "arrived", "prompt"], events
    assert early_events[:5] == ["prompt", "window", "queued", "arrived", "prompt"], early_events
    for a, b, c in zip(single, late, early, strict=True):
        assert a.num_generated == b.num_generated > 1
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.token_ids, c.token_ids)
        torch.testing.assert_close(a.hidden_states, b.hidden_states, atol=1e-5, rtol=1e-5)


def test_an_arrival_ends_a_full_window_after_the_steps_queued_ahead(chat, make_engine):
    """``EngineConfig.open_window_max_seqs``: with ``arrivals`` set, a full window is queued a few steps ahead of the
    device and a request that arrives during it ends it there (its blocks for the rest stay reserved); a window
    bringing a sequence to its first audio runs whole even when a request arrives. The tokens are those of
    one-step scheduling."""
    texts = ["running for a while", "arrives in a full window", "arrives in a first window"]
    ps = [sampled(11, min_new_tokens=30, max_new_tokens=30), sampled(12, min_new_tokens=12, max_new_tokens=12),
          sampled(13, min_new_tokens=6, max_new_tokens=6)]

    def generate(window: int, lookahead: int | None) -> tuple[list, list]:
        engine = make_engine(num_decode_steps=window, window_stops=(6,), pipeline_decode=window > 1,
                             window_lookahead=lookahead or 4, open_window_max_seqs=16 if lookahead else 0)
        collected = []
        collect = engine.runner.collect
        engine.runner.collect = lambda w: (collected.append((w.decode, w.num_steps)), collect(w))[1]
        seqs = {}

        def add(i: int) -> None:
            engine.add_request(f"r{i}", code_prompt(chat, texts[i]), ps[i])
            seqs[i] = engine.requests[f"r{i}"]

        def arrivals() -> bool:
            if 1 not in seqs and seqs[0].num_generated >= 6:  # a full window of r0
                add(1)
                return True
            if 1 in seqs and 2 not in seqs and seqs[1].num_generated >= 1:  # r1's first window
                add(2)
                return True
            return False

        engine.arrivals = arrivals if window > 1 else None
        add(0)
        done = {}
        while engine.has_unfinished_requests():
            if window == 1 and 1 not in seqs and seqs[0].num_generated >= 8:  # the reference, one step at a time
                add(1)
            elif lookahead is None and 1 in seqs and 2 not in seqs and seqs[1].num_generated >= 1:
                add(2)  # (whole windows: no call of ``arrivals`` between r1's windows)
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        return [done[f"r{i}"] for i in range(3)], collected

    single, _ = generate(1, None)
    cut, windows = generate(8, lookahead=2)
    whole, whole_windows = generate(8, lookahead=None)
    # r0: its prompt, its first window (5), a full window ended after 2 steps by r1; r1's prompt, then the
    # first window of both (5 steps), whole although r2 arrived during it
    assert windows[:5] == [(False, 1), (True, 5), (True, 2), (False, 1), (True, 5)], windows
    assert whole_windows[:3] == [(False, 1), (True, 5), (True, 8)], whole_windows
    for a, b, c in zip(single, cut, whole, strict=True):
        assert a.num_generated == b.num_generated == c.num_generated
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.token_ids, c.token_ids)
        torch.testing.assert_close(a.hidden_states, b.hidden_states, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="window_lookahead"):
        make_engine(window_lookahead=0)
    with pytest.raises(ValueError, match="open_window_max_seqs"):
        make_engine(open_window_max_seqs=-1)


@pytest.mark.parametrize("batch", [1, 2])
def test_windows_run_open_only_up_to_open_window_max_seqs(chat, make_engine, batch):
    """A batch of more than ``open_window_max_seqs`` sequences runs whole windows (an arrival would end each)."""
    engine = make_engine(num_decode_steps=8, window_stops=(), pipeline_decode=True, window_lookahead=2,
                         open_window_max_seqs=1)
    kinds = []
    record_windows(engine, lambda w, continuing: kinds.append(type(w).__name__))
    engine.arrivals = lambda: False
    for i in range(batch):
        engine.add_request(f"r{i}", code_prompt(chat, f"batch of {batch}"), params(min_new_tokens=20, max_new_tokens=20))
    finals = [out for out in iter_steps(engine) if out.finished]
    assert [out.num_generated for out in finals] == [20] * batch
    assert ("OpenWindow" in kinds) == (batch == 1) and "LaunchedStep" in kinds, kinds


def test_a_step_launched_ahead_is_aborted_or_fails_like_any_step(chat, make_engine):
    """``launch_ahead`` launches only what leads to first audio (a prompt step, a short first window), not
    a full window; a request aborted while its prompt step was launched ahead frees its blocks; a launch
    that fails is the next step's failure (a batch of one: that request fails, the engine goes on)."""
    engine = make_engine(block_size=4, num_decode_steps=4, window_stops=(3,), pipeline_decode=True,
                         prefill_first=True)
    bm = engine.block_manager
    assert not engine.launch_ahead(), "nothing to run"
    engine.add_request("a", code_prompt(chat, "launched ahead"), params(min_new_tokens=12, max_new_tokens=12))
    assert engine.launch_ahead() and not engine.launch_ahead(), "one step at a time"
    assert engine.abort_request("a")
    (out,) = engine.step()
    assert out.finish_reason is FinishReason.ABORT and bm.num_free_blocks == bm.num_blocks

    engine.add_request("b", code_prompt(chat, "runs"), params(min_new_tokens=12, max_new_tokens=12))
    engine.step()  # its prompt step: one token
    assert engine.launch_ahead(), "its short first window (2 of 4 steps) leads to first audio"
    engine.step()
    assert not engine.launch_ahead(), "a full window is not launched ahead"
    launch = engine.runner.launch

    def broken(plan):
        raise RuntimeError("launch failed")

    engine.add_request("c", code_prompt(chat, "fails"), params(min_new_tokens=4, max_new_tokens=4))
    engine.runner.launch = broken
    assert engine.launch_ahead()
    engine.runner.launch = launch
    outs = {o.request_id: o for o in engine.step()}
    assert outs["c"].finish_reason is FinishReason.ERROR and "launch failed" in str(outs["c"].error)
    reasons = {}
    while engine.has_unfinished_requests():
        reasons.update({o.request_id: o.finish_reason for o in engine.step() if o.finished})
    assert reasons == {"b": FinishReason.LENGTH} and bm.num_free_blocks == bm.num_blocks


def test_different_seeds_give_different_audio_and_unseeded_uses_fresh_seeds(chat, make_engine):
    target = code_prompt(chat, "seeds matter")
    a, b = run(make_engine(), [target, target], [sampled(1, min_new_tokens=20), sampled(2, min_new_tokens=20)])
    assert not torch.equal(a.token_ids, b.token_ids)
    free = sampled(None, min_new_tokens=20)
    c, d = run(make_engine(), [target, target], [free, free])
    assert not torch.equal(c.token_ids, d.token_ids)


def test_speaker_and_voice_sample_change_the_output(chat, make_engine, workload):
    prompts, _ = workload
    speaker, sample = prompts[1], prompts[2]
    bare = Prompt(speaker.ids, speaker.text_mask, None)
    p = params(min_new_tokens=10, max_new_tokens=10)
    with_spk, without = run(make_engine(), [speaker, bare], [p, p])
    assert not torch.equal(with_spk.hidden_states, without.hidden_states)
    text_only = code_prompt(chat, "a voice sample follows", spk=None)
    with_smp, no_smp = run(make_engine(), [sample, Prompt(text_only.ids, text_only.text_mask, sample.speaker)], [p, p])
    assert not torch.equal(with_smp.hidden_states[:1], no_smp.hidden_states[:1])


@pytest.mark.parametrize("pipeline", [False, True])
def test_no_window_runs_past_every_sequence_s_length_limit(chat, make_engine, pipeline):
    """13 tokens in windows of 8: the prefill's token, a window of 8, then a window of the 4 left (a full window
    would compute 4 steps nobody can use), whether or not the last window is queued behind the previous one."""
    engine = make_engine(num_decode_steps=8, window_stops=(), pipeline_decode=pipeline)
    launched = []
    record_windows(engine, lambda window, continuing: launched.append(window.num_steps))
    engine.add_request("s", code_prompt(chat, "no wasted steps"), params(min_new_tokens=13, max_new_tokens=13))
    final = [out for out in iter_steps(engine) if out.finished][0]
    assert launched == [8, 4]
    assert final.finish_reason is FinishReason.LENGTH and final.num_generated == 13


def iter_steps(engine):
    while engine.has_unfinished_requests():
        yield from engine.step()


@pytest.mark.parametrize("window", [1, 4])
def test_every_decode_step_runs_as_a_decoder_window(chat, make_engine, window):
    """One forward path: prompt steps run the runner's prefill forward, every decode step (audio and text) a
    window of the decoder, a lone step being a window of one."""
    engine = make_engine(num_decode_steps=window)
    runner = engine.runner
    forwarded, windows = [], []
    forward = runner.forward
    runner.forward = lambda scheduled: (forwarded.extend(item.seq.num_generated for item in scheduled),
                                        forward(scheduled))[1]
    record_windows(engine, lambda w, continuing: windows.append((w.seqs[0].text_mode, len(w.seqs), w.num_steps)))
    engine.add_request("a", code_prompt(chat, "one path"), params(min_new_tokens=9, max_new_tokens=9))
    engine.add_request("b", code_prompt(chat, "for every step"), params(min_new_tokens=9, max_new_tokens=9))
    engine.add_request("t", text_prompt(chat, "and refine too"), params(Mode.TEXT, min_new_tokens=5, max_new_tokens=5,
                                                                      return_hidden_states=False))
    finals = [out for out in iter_steps(engine) if out.finished]
    assert sorted(out.num_generated for out in finals) == [5, 9, 9]
    assert forwarded == [0, 0, 0], "only the prompts went through the prefill forward"
    # each request's first token came from its prompt step, the rest from windows
    assert sum(n * k for text, n, k in windows if not text) == 2 * 8 and sum(k for text, _, k in windows if text) == 4
    assert max(k for _, _, k in windows) == window


@pytest.mark.parametrize("window", [1, 4])
def test_step_reports_each_new_token_incrementally(chat, make_engine, window):
    engine = make_engine(num_decode_steps=window)
    engine.add_request("s", code_prompt(chat, "stream me"), params(min_new_tokens=6, max_new_tokens=6))
    pieces, hidden, final = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.new_token_ids)
            hidden.append(out.new_hidden_states)
            final = out
    # the prefill samples one token, then each step decodes a window (the last one stops at the length limit)
    assert [len(x) for x in pieces] == ([1] * 6 if window == 1 else [1, 4, 1])
    assert final.finished and final.finish_reason is FinishReason.LENGTH and final.num_generated == 6
    assert torch.equal(torch.cat(pieces), final.token_ids)
    assert torch.equal(torch.cat(hidden), final.hidden_states)


def _token_by_token(runner, scheduled) -> dict:
    """What ``ModelRunner._prepare`` must give, built one token at a time."""
    want = {k: [] for k in ("ids", "pos", "slots", "text", "code", "spk", "speakers", "last", "cu", "ctx")}
    bs, row = runner.block_size, 0
    want["cu"].append(0)
    for item in scheduled:
        seq = item.seq
        for p in range(item.start, item.start + item.num_new_tokens):
            token = seq.tokens[p]
            want["ids"].append(list(token))
            want["pos"].append(p)
            want["slots"].append(seq.block_table[p // bs] * bs + p % bs)
            if seq.is_text[p]:
                want["text"].append(row)
                if seq.speaker is not None and token[0] == runner.spk_emb_id:
                    want["spk"].append(row)
                    want["speakers"].append(seq.speaker)
            else:
                want["code"].append(row)
            row += 1
        want["cu"].append(row)
        want["ctx"].append(item.start + item.num_new_tokens)
        if item.samples:
            want["last"].append(row - 1)
    return want


def test_a_prompt_steps_inputs_equal_a_token_by_token_build(chat, make_engine, workload):
    """``ModelRunner._prepare`` (numpy a sequence at a time) gives what a loop over every token gives: ids,
    positions, KV slots, bounds, block tables, the sampled rows, the text / audio / ``[spk_emb]`` rows and the
    speaker vectors; over prompts with and without speakers, in chunks, after a prefix-cache hit."""
    prompts, ps = workload
    engine = make_engine(max_num_batched_tokens=40, block_size=4)
    runner, prepare, checked, errors = engine.runner, engine.runner._prepare, [], []

    def checking(scheduled):  # (the engine would take a failed check for a failed step: kept to assert after)
        try:
            return compare(scheduled)
        except AssertionError as err:
            errors.append(err)
            raise

    def compare(scheduled):
        out = prepare(scheduled)
        ids, meta, last_rows, (text_rows, code_rows, spk_rows, speakers) = out
        want = _token_by_token(runner, scheduled)
        assert ids.tolist() == want["ids"] and last_rows.tolist() == want["last"]
        assert meta.positions.tolist() == want["pos"] and meta.slot_mapping.tolist() == want["slots"]
        assert meta.cu_seqlens_q.tolist() == want["cu"] and meta.context_lens.tolist() == want["ctx"]
        for table, item in zip(meta.block_tables.tolist(), scheduled, strict=True):
            assert table[: len(item.seq.block_table)] == item.seq.block_table
            assert not any(table[len(item.seq.block_table):])
        assert (text_rows.tolist(), code_rows.tolist(), spk_rows.tolist()) == (want["text"], want["code"], want["spk"])
        assert (speakers is None) == (not want["speakers"])
        if speakers is not None:
            assert torch.equal(speakers, torch.stack(want["speakers"]))
        checked.append((len(scheduled), len(want["spk"]), min(item.start for item in scheduled)))
        return out

    runner._prepare = checking
    run(engine, prompts, ps)
    run(engine, prompts[:1], ps[:1])  # a prompt the prefix cache holds: its step starts past the hit
    assert not errors, errors[0]
    assert any(spk for _, spk, _ in checked) and any(start > 0 for _, _, start in checked), checked
    assert max(n for n, _, _ in checked) > 1


def test_tokens_a_step_default_by_device_and_are_checked(chat, make_engine):
    """``max_num_batched_tokens``: None takes the CPU's default (prompts share a step with running decodes
    there, so a long one stays short); a given value is kept; zero is refused."""
    from chattts_velocity.engine.llm_engine import CPU_BATCHED_TOKENS

    assert make_engine().scheduler.max_num_batched_tokens == CPU_BATCHED_TOKENS
    assert make_engine(max_num_batched_tokens=96).scheduler.max_num_batched_tokens == 96
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)


def test_sequences_finishing_together_report_the_hidden_states_their_steps_gave(chat, make_engine):
    """Sequences finishing in one step (a batch that ran together, one stopping a step early, a later arrival)
    each report whole hidden states equal to what their reports gave piece by piece."""
    engine = make_engine(num_decode_steps=4)
    lengths = {"a": 10, "b": 10, "c": 10, "short": 9}
    for rid, n in lengths.items():
        engine.add_request(rid, code_prompt(chat, f"together {rid}"), params(min_new_tokens=n, max_new_tokens=n))
    pieces, final = {}, {}
    first = True
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.setdefault(out.request_id, []).append(out.new_hidden_states)
            if out.finished:
                final[out.request_id] = out
        if first:
            engine.add_request("late", code_prompt(chat, "late"), params(min_new_tokens=6, max_new_tokens=6))
            first = False
    assert set(final) == {*lengths, "late"}
    for rid, out in final.items():
        assert out.hidden_states.shape == (out.num_generated, chat.model.config.hidden_size)
        assert torch.equal(torch.cat(pieces[rid]), out.hidden_states), rid


@pytest.mark.parametrize("window", [1, 8])
def test_abort_mid_generation_frees_every_block(chat, make_engine, window):
    engine = make_engine(block_size=4, num_decode_steps=window, pipeline_decode=window > 1,  # aborts in flight
                         window_stops=())
    bm = engine.block_manager
    for i in range(3):
        engine.add_request(f"a{i}", code_prompt(chat, f"abort me {i}"), params(min_new_tokens=50, max_new_tokens=50))
    for _ in range(5):
        engine.step()
    assert bm.num_free_blocks < bm.num_blocks
    assert engine.abort_request("a1")
    assert not engine.abort_request("a1"), "a second abort is a no-op"
    assert not engine.abort_request("never-added")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a1"].finished and outs["a1"].finish_reason is FinishReason.ABORT
    assert outs["a1"].token_ids.shape[0] == 1 + 4 * window  # a prefill step, then 4 windows
    assert outs["a0"].num_generated == 1 + 5 * window and not outs["a0"].finished
    engine.abort_request("a0")
    engine.abort_request("a2")
    engine.step()
    assert bm.num_free_blocks == bm.num_blocks


def test_abort_of_a_waiting_request(chat, make_engine):
    engine = make_engine(max_num_seqs=1)
    engine.add_request("run", code_prompt(chat, "runs"), params(min_new_tokens=3, max_new_tokens=3))
    engine.add_request("wait", code_prompt(chat, "waits"), params())
    engine.step()
    assert engine.abort_request("wait")
    reasons = {}
    while engine.has_unfinished_requests():
        reasons.update({o.request_id: o.finish_reason for o in engine.step() if o.finished})
    assert reasons == {"wait": FinishReason.ABORT, "run": FinishReason.LENGTH}


def test_bad_requests_are_rejected_and_the_engine_keeps_serving(chat, make_engine):
    engine = make_engine(num_kv_blocks=8, block_size=4)  # 32 tokens of KV
    good = code_prompt(chat, "good")
    engine.add_request("good", good, params(min_new_tokens=4, max_new_tokens=4))
    ids, mask = good.ids, good.text_mask
    hidden = chat.model.config.hidden_size
    bad = [
        ("empty prompt", Prompt(ids[:0], mask[:0]), params(), "empty"),
        ("too long for the cache", Prompt(ids.repeat(6, 1), mask.repeat(6)), params(), "KV cache"),
        ("bad temperature", good, params(temperature=(0.0,)), "temperature"),
        ("bad top_p", good, params(top_p=1.5), "top_p"),
        ("min above max", good, params(min_new_tokens=9, max_new_tokens=3), "min_new_tokens"),
        ("text temperatures", good, params(Mode.TEXT, temperature=(0.1, 0.1, 0.1, 0.1)), "temperature"),
        ("audio id out of range", Prompt(torch.cat([ids, torch.full((1, 4), 626)]), torch.cat([mask, mask[:1] & False])),
         params(), "audio ids"),
        ("text id out of range", Prompt(ids + 10**6, mask), params(), "text ids"),
        ("float ids", Prompt(ids.float(), mask), params(), "integer tensor"),
        ("mask shape", Prompt(ids, mask[:-1]), params(), "text_mask"),
        ("speaker shape", Prompt(ids, mask, torch.ones(3)), params(), "speaker"),
        # checked through numpy where numpy has the dtype (no torch op on a request thread), else by torch
        ("speaker NaN", Prompt(ids, mask, torch.full((hidden,), float("nan"), dtype=torch.float16)), params(),
         "finite"),
        ("speaker inf, bfloat16", Prompt(ids, mask, torch.full((hidden,), float("inf"), dtype=torch.bfloat16)),
         params(), "finite"),
        ("duplicate id", good, params(), "already in use"),
    ]
    for name, prompt, p, match in bad:
        rid = "good" if name == "duplicate id" else name
        with pytest.raises(ValueError, match=match):
            engine.add_request(rid, prompt, p)
    assert list(engine.requests) == ["good"]
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].request_id == "good" and outs[-1].num_generated == 4


def test_a_speaker_vector_is_kept_as_float32_whatever_its_dtype(chat, make_engine):
    """The sequence's speaker (its embedding and its prefix-cache key) is the vector in float32, whether
    converted through numpy (float16) or torch (bfloat16), and the caller's tensor is left alone."""
    engine = make_engine()
    good = code_prompt(chat, "a voice", spk=chat.sample_random_speaker())
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        spk = good.speaker.to(dtype)
        seq = engine.make_sequence(f"speaker-{dtype}", Prompt(good.ids, good.text_mask, spk), params())
        assert seq.speaker.dtype == torch.float32 and torch.equal(seq.speaker, spk.float())
        assert seq.speaker.data_ptr() != spk.data_ptr()
    same = [engine.make_sequence(f"key-{i}", good, params()).speaker_key for i in range(2)]
    assert same[0] == same[1] != b""


def test_length_is_capped_by_the_model_context(chat, make_engine):
    engine = make_engine()
    prompt = code_prompt(chat, "near the end of the context")
    room = chat.model.config.max_position_embeddings - prompt.ids.size(0)
    (out,) = run(engine, [prompt], [params(min_new_tokens=room + 5, max_new_tokens=room + 5)])
    # cut short of what was asked: the reason says so (LENGTH is kept for max_new_tokens itself)
    assert out.finish_reason is FinishReason.CAPACITY and out.num_generated == room


@pytest.mark.parametrize("path", ["cpu-window", "device-step"])
def test_text_windows_match_single_steps_and_the_reference(chat, make_engine, path):
    """Refine requests decode in windows, one row a sequence with the text head and the text EOS: the tokens of
    one-step windows, bit for bit (sampled, with penalties, EOS and length endings), and for an argmax
    request the reference loop's. ``device-step``: the window runs the step CUDA captures as a graph
    (``MultiStepDecoder._step``, here eagerly with the torch kernels) instead of the CPU's own loop."""

    def make(**kw):
        engine = make_engine(**kw)
        decoder = engine.runner.decoder
        if path == "device-step":
            decoder._run_cpu = lambda b, k, text=False: [decoder._step(b, text) for _ in range(k)]
        return engine

    texts = [f"refine this sentence number {i} please" for i in range(4)]
    ps = [params(Mode.TEXT, temperature=(0.7,), seed=70 + i, repetition_penalty=1.2 if i % 2 else 1.0,
                 top_k=None if i == 2 else 20, max_new_tokens=12 + 7 * i, return_hidden_states=False)
          for i in range(4)]
    ps[3] = dataclasses.replace(ps[3], min_new_tokens=33, max_new_tokens=33)  # ends by its length limit

    def generate(window: int) -> tuple[list, list[tuple[bool, int]]]:
        engine = make(num_decode_steps=window)
        windows = []
        record_windows(engine, lambda window, continuing: windows.append(
            (all(s.text_mode for s in window.seqs), window.num_steps)))
        for i, text in enumerate(texts):
            engine.add_request(f"r{i}", text_prompt(chat, text), ps[i])
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        return [done[f"r{i}"] for i in range(4)], windows

    single, steps = generate(1)
    windowed, windows = generate(8)
    assert steps and all(text and k == 1 for text, k in steps), "one-step scheduling: text windows of one step"
    assert all(text for text, _ in windows) and max(k for _, k in windows) > 1, "the refine batch in text windows"
    assert FinishReason.LENGTH in {out.finish_reason for out in single}
    for a, b in zip(single, windowed, strict=True):
        assert torch.equal(a.token_ids, b.token_ids) and a.finish_reason == b.finish_reason
    argmax = params(Mode.TEXT, repetition_penalty=1.0, top_k=None, max_new_tokens=20, return_hidden_states=False)
    engine = make(num_decode_steps=8)
    engine.add_request("argmax", text_prompt(chat, texts[0]), argmax)
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), None)
    assert_matches_reference(chat, [out], [text_prompt(chat, texts[0])], [argmax])


@pytest.mark.parametrize("host", ["numpy", "lists"])
def test_prompt_ids_are_checked_against_their_kind(make_engine, monkeypatch, host):
    """A prompt's text positions take text ids, its audio positions audio codes; either out of range is a
    ``ValueError`` naming the kind (the check runs in numpy, or on Python lists for tensors numpy cannot read
    (on a GPU), never as tensor ops)."""
    from chattts_velocity.engine import validation

    if host == "lists":
        monkeypatch.setattr(validation, "_host_array", lambda vec: None)
    engine = make_engine()
    cfg = engine.model_config
    mask = torch.tensor([True, True, False])
    good = torch.tensor([[5] * 4, [cfg.num_text_tokens - 1] * 4, [cfg.num_audio_tokens - 1] * 4])
    tokens, is_text = engine.validate_request(Prompt(good, mask), SamplingParams())
    assert tokens.dtype == np.int64 and tokens.tolist() == good.tolist() and is_text == [True, True, False]
    for row, value, kind in ((1, cfg.num_text_tokens, "text"), (0, -1, "text"), (2, cfg.num_audio_tokens, "audio"),
                             (2, -3, "audio")):
        bad = good.clone()
        bad[row, 1] = value
        with pytest.raises(ValueError, match=f"prompt has {kind} ids outside"):
            engine.validate_request(Prompt(bad, mask), SamplingParams())


def test_window_tokens_come_back_through_a_contiguous_host_buffer(chat, make_engine):
    """A window's tokens are copied into a contiguous [K, n, Q] view of the host buffer, also for a batch
    smaller than the largest: into a [:K, :n] slice torch copies through a pageable temporary, which on CUDA
    waits for the window in flight."""
    engine = make_engine(num_decode_steps=4, max_num_seqs=8)
    windows = []
    record_windows(engine, lambda window, continuing: windows.append(window))
    for i in range(3):
        engine.add_request(f"w{i}", code_prompt(chat, f"window buffer {i}"), sampled(7 + i, min_new_tokens=9,
                                                                                     max_new_tokens=12))
    while engine.has_unfinished_requests():
        engine.step()
    assert windows and {len(w.seqs) for w in windows} == {3}
    for w in windows:
        assert w.tokens.shape == (w.num_steps, 3, 4) and w.tokens.is_contiguous()


def test_one_fused_code_table_serves_the_prefill_steps_and_the_windows(chat, make_engine):
    """The prefill steps and the decode windows of an engine embed audio codes through one table, which the
    codebooks' weights are views of (held once)."""
    engine = make_engine(num_decode_steps=4)
    table = engine.runner._code_table
    assert engine.runner.decoder._code_table is table
    emb = chat.model.gpt.embed.emb_code
    assert all(e.weight.data_ptr() == table[q * e.num_embeddings].data_ptr() for q, e in enumerate(emb))


def test_the_engine_times_its_decode_windows_and_a_later_stop_follows_the_budget(chat, make_engine):
    """The engine gives the scheduler each decode window's step time; a window stop after the first ends a
    young stream's window only while a full window at that step time would outlast
    ``window_stop_budget_ms``: always with a budget of 0, never with one no window reaches."""

    def windows(budget_ms: float) -> tuple[list[int], float]:
        engine = make_engine(num_decode_steps=8, window_stops=(3, 5), window_stop_budget_ms=budget_ms)
        steps = []
        collect = engine.runner.collect
        engine.runner.collect = lambda w: (steps.append(w.num_steps) if w.decode else None, collect(w))[1]
        engine.add_request("r", code_prompt(chat, "a young stream"), sampled(3, min_new_tokens=14,
                                                                              max_new_tokens=14))
        while engine.has_unfinished_requests():
            engine.step()
        return steps, engine.scheduler.step_s

    # the prompt step samples token 1; then windows to 3 tokens and (with the later stop) to 5
    steps, step_s = windows(0.0)
    assert steps[:3] == [2, 2, 8] and step_s > 0
    steps, step_s = windows(1e9)
    assert steps[:2] == [2, 8] and step_s > 0
