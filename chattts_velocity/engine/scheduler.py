"""``Scheduler``: continuous batching. Every step it picks, first come first served, how many tokens of each
sequence to compute: running sequences first (a decode is one token, a prefill a chunk of its prompt), then
waiting ones while the token budget, the sequence limit and the KV blocks allow. With ``prefill_first`` a step
that has prompts to compute (waiting requests, or a long prompt's next chunk) computes prompts only (up to ``max_prefill_seqs`` sequences and
``max_prefill_tokens`` tokens, what one prefill CUDA graph takes) and the running decodes wait for the next
step, which runs them all as one window: mixed in, hundreds of decodes would make the prefill step an eager one
of hundreds of sequences. When blocks run out the most
recently admitted sequence is preempted: its blocks are freed and it is recomputed later (its prefix may still
be in the prefix cache).

The scheduler also owns what a step does to its sequences (``computed``, ``accept``, ``finish``: tokens
appended, tokens computed, full blocks cached, the end and its reason), so every change of a sequence's state
and blocks happens here or in its block manager; the engine only runs the device work and reports.

After a failed step the engine puts that step's sequences in quarantine: they are preempted and marked as
suspects, and a batch holds at most one suspect until it has run a step of its usual kind, so a request whose
presence makes steps fail is found and failed alone. Pure Python: no torch."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .block_manager import BlockSpaceManager
from .sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    """Tokens computed this step, from ``start`` on."""
    start: int = field(init=False)
    """``seq.num_computed_tokens`` when scheduled."""
    samples: bool = field(init=False)
    """This step reaches the sequence's last token, so its next token is sampled."""

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_new_tokens == len(self.seq)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    decode: bool = False
    """Every sequence decodes one token it generated, all in one mode (audio or text): a decode window."""
    num_steps: int = 1
    """Decode steps to run: > 1 only in a decode window whose sequences all have blocks for them."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


FIT_MARGIN = 1.25
"""How much longer than the host's work between two windows ``Scheduler.fit_window`` makes a window on the
device: the host's part varies from window to window (an audio round decodes more windows one time than the
next), and a window a little long costs a few steps of latency where one too short idles the device."""

GROW_AT = 1.5
"""How many times a window's device time the host's work between two windows must take before
``Scheduler.fit_window`` grows the windows: below it the device idles a third of the time or less, and a
server's windows, whose rounds and reports mostly fit, paid more for the changes of length than they saved
(docs/perf/serve.md)."""

MIN_CAPPED_STEPS = 8
"""The fewest steps ``max_window_tokens`` cuts a decode window to: shorter windows of a large batch cost the
server much of its throughput (`chattts-velocity bench serve` with `--max-window-tokens`; docs/perf/)."""


class Scheduler:
    def __init__(self, block_manager: BlockSpaceManager, max_num_seqs: int, max_num_batched_tokens: int,
                 num_decode_steps: int = 1, window_stops: tuple[int, ...] = (), max_window_tokens: int | None = None,
                 prefill_first: bool = False, max_prefill_seqs: int | None = None,
                 max_prefill_tokens: int | None = None, window_stop_budget_ms: float | None = None,
                 window_budget_ms: float | None = None, max_decode_steps: int | None = None):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_decode_steps = num_decode_steps
        self.max_decode_steps = num_decode_steps if max_decode_steps is None else max_decode_steps
        """``EngineConfig.max_decode_steps``: the most steps ``fit_window`` grows a full window to."""
        self.fitted_steps = num_decode_steps
        """Steps of a full window now (``fit_window``): ``num_decode_steps`` up to ``max_decode_steps``."""
        self.fitted_batch = 0
        """The batch of the window that last grew ``fitted_steps``: a batch under half of it (the load fell, and
        with it the audio rounds' work) runs ``num_decode_steps`` (``full_window_steps``)."""
        self.window_stops = window_stops
        """``EngineConfig.window_stops``: where the youngest audio sequence's window ends (``next_stop``)."""
        self.window_stop_budget_s = None if window_stop_budget_ms is None else window_stop_budget_ms / 1e3
        """``EngineConfig.window_stop_budget_ms`` in seconds: a stop after the first applies only while
        a full window (``full_window_steps`` steps of ``step_s``) would take longer. None: every stop applies."""
        self.window_budget_s = None if window_budget_ms is None else window_budget_ms / 1e3
        """``EngineConfig.window_budget_ms`` in seconds: a full window runs at most this long at ``step_s``
        (``full_window_steps``). None: ``num_decode_steps``."""
        self.step_s = 0.0
        """Seconds per step of the latest decode window (``LLMEngine`` measures it)."""
        self.max_window_tokens = max_window_tokens
        self.backlog: Callable[[], bool] | None = None
        """Whether requests wait outside the engine for a running slot (a server's admission queue; set by
        ``AsyncLLMEngine.set_backlog``): then the server is at its limit, an arriving request waits for a slot
        rather than for a window, and windows run whole whatever ``max_window_tokens`` says (capped, a server
        past its capacity delivered less and its queue grew: docs/perf/serve.md). None: no such queue."""
        self.prefill_first = prefill_first
        self.max_prefill_seqs = max_prefill_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self._text_turn = False
        """Which mode's decodes a step of mixed audio and text decodes keeps (see ``_one_mode``)."""
        self._num_added = 0
        self._sized_at = 0
        """``_num_added`` when a window was last sized: requests added since came in while the engine ran,
        which is when ``max_window_tokens`` caps a window (``window_steps``)."""
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.suspects: set[int] = set()
        """``seq_id`` of quarantined sequences (see ``quarantine``)."""
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._num_added += 1

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def next_stop(self, seqs: list[Sequence]) -> int | None:
        """Steps until the youngest audio sequence of ``seqs`` reaches its next window stop (``window_stops``),
        where its window ends; None once it is past the last (or for text sequences), or where the next is a
        later stop that a full window does not need (``window_stop_budget_s``). Only the youngest sets
        it: the older ones pass their stops inside its window, and under a steady flow of arrivals windows cut
        at every sequence's stop would be a step or two long."""
        ages = [seq.num_generated for seq in seqs if not seq.text_mode]
        if not ages:
            return None
        n = min(ages)
        for i, stop in enumerate(self.window_stops):
            if stop > n:
                budget = self.window_stop_budget_s
                if i and budget is not None and self.full_window_steps(len(seqs)) * self.step_s <= budget:
                    return None  # a full window still ends before the first chunk has played
                return stop - n
        return None

    def before_first_audio(self) -> bool:
        """Whether the next step serves sequences on their way to their first audio: prompts to compute
        (waiting requests, a chunked prompt's rest) or an audio sequence short of the first window stop (its
        short first window). Such a step is short, and a stream's first audio waits for it."""
        first = self.window_stops[0] if self.window_stops else 0
        return bool(self.waiting) or any(
            not _decodes(seq) or (not seq.text_mode and seq.num_generated < first) for seq in self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.prefill_first:  # prompts to compute (waiting, or chunked ones running): a step of their own
            self._schedule_prefills(out)
            if out.scheduled:
                return out
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        if out.scheduled:
            self._one_mode(out)
            out.decode = self._one_window(out.scheduled)
            if out.decode:
                self._reserve_window(out)
        return out

    def _one_mode(self, out: SchedulerOutput) -> None:
        """A step of nothing but decodes, audio and text (refine) mixed, keeps one mode's, audio and text in
        turn: a decode window runs one mode. The others stay running with their next token's slot already
        reserved."""
        if not all(_is_decode(item) for item in out.scheduled):
            return
        modes = {item.seq.text_mode for item in out.scheduled}
        if len(modes) == 2:
            self._text_turn = not self._text_turn
            out.scheduled = [item for item in out.scheduled if item.seq.text_mode == self._text_turn]

    def _one_window(self, scheduled: list[ScheduledSeq]) -> bool:
        """Every sequence decodes one token it generated itself, all in the same mode (audio or text)."""
        text = scheduled[0].seq.text_mode
        return all(_is_decode(item) and item.seq.text_mode == text for item in scheduled)

    def full_window_steps(self, batch: int) -> int:
        """Steps of a full decode window (of ``batch`` sequences): ``fitted_steps`` (``num_decode_steps`` for a
        batch under half of ``fitted_batch``), fewer where that many steps of ``step_s`` would
        outlast ``window_budget_s``, but never fewer than two: a single step is no window, and without windows
        ``step_s`` would not be measured again when the steps get faster."""
        k = self.fitted_steps if 2 * batch >= self.fitted_batch else self.num_decode_steps
        if self.window_budget_s is not None and self.step_s > 0:
            k = min(k, max(2, int(self.window_budget_s / self.step_s + 1e-9)))  # (1e-9: 0.15 / 0.025 is 5.999...)
        return k

    def fit_window(self, steps: int, device_s: float, host_s: float, batch: int) -> None:
        """Size the next full windows to the host: a window of ``steps`` steps of ``batch`` sequences, queued
        behind another, ran ``device_s`` on the device while the host worked ``host_s`` (reading the window
        before it, the reports, the audio rounds) before it came back for it, and the device idled for the
        difference. Where the host took ``GROW_AT`` times the window or longer, the full windows grow to cover
        its work with ``FIT_MARGIN`` to spare (at most doubling at once, up to ``max_decode_steps``); where they
        cover it with more than that to spare, they shrink as far, never below ``num_decode_steps``. In between
        they stay: a window that changes length is one the device may idle before, and a small idle costs
        less."""
        if steps < 1 or device_s <= 0:
            return
        want = math.ceil(FIT_MARGIN * host_s * steps / device_s)
        if host_s >= GROW_AT * device_s:
            grown = min(want, 2 * self.fitted_steps, self.max_decode_steps)
            if grown > self.fitted_steps:
                self.fitted_steps, self.fitted_batch = grown, batch
        elif want < self.fitted_steps:
            self.fitted_steps = max(self.num_decode_steps, want)

    def window_steps(self, batch: int) -> int:
        """Steps of a full decode window of ``batch`` sequences: ``full_window_steps``, fewer where
        ``max_window_tokens`` caps steps x batch (never fewer than ``MIN_CAPPED_STEPS``) while requests come
        in: one waits, or one was added since the last window was sized, unless a ``backlog`` waits for running
        slots. A window that no arrival waits for runs whole: each window's end costs a server its report and
        audio round, so a large batch's capped windows deliver less audio (docs/perf/serve.md)."""
        k = self.full_window_steps(batch)
        if (self.max_window_tokens is not None and (self.waiting or self._num_added != self._sized_at)
                and not (self.backlog is not None and self.backlog())):
            k = min(k, max(MIN_CAPPED_STEPS, self.max_window_tokens // batch))
        return k

    def _reserve_window(self, out: SchedulerOutput) -> None:
        """Give every sequence blocks for ``window_steps`` tokens (fewer near its length limit), or keep the
        single step if any lacks them: a longer window never preempts anybody."""
        bm, k = self.block_manager, self.window_steps(len(out.scheduled))
        self._sized_at = self._num_added
        seqs = [s.seq for s in out.scheduled]
        stop = self.next_stop(seqs)
        if stop is not None:  # a short window brings a young stream to its first audio (or its next chunk) sooner
            k = min(k, stop)
        k = min(k, max(seq.max_tokens - len(seq) for seq in seqs))  # no steps past every length limit
        if k < 2:
            return
        if bm.allocate_together(seqs, [min(k, seq.max_tokens - len(seq)) for seq in seqs]):
            out.num_steps = k

    def continue_window(self, seqs: list[Sequence], num_steps: int) -> int:
        """Steps of the same batch's next window, to be queued behind a running window of ``num_steps`` steps
        whose tokens are not appended yet, with every sequence's blocks for it reserved now; 0 (nothing
        reserved) if the batch could change before it: a request waiting, a sequence not in the batch, the
        running window short (a short first window is there for latency: it is reported before more is
        queued, as CUDA graph replays are host-bound at batch 1: docs/perf/), a sequence
        finished or reaching its length limit inside the running window, the youngest short of a window stop
        after it (its window ends there), or too few free blocks."""
        k = self.window_steps(len(seqs))
        if self.waiting or len(self.running) != len(seqs) or num_steps < min(k, self.num_decode_steps):
            return 0
        stop = self.next_stop(seqs)
        if stop is not None and stop > num_steps:  # the youngest is short of a stop after it: its window ends there
            return 0
        wanted = []  # tokens past the appended ones: the running window's, then the next one's
        for seq in seqs:
            if seq.is_finished or len(seq) + num_steps >= seq.max_tokens:
                return 0
            wanted.append(num_steps + min(k, seq.max_tokens - len(seq) - num_steps))
        if not self.block_manager.allocate_together(seqs, wanted):
            return 0
        return max(n - num_steps for n in wanted)

    def _schedule_prefills(self, out: SchedulerOutput) -> None:
        """A step of prompts only: the running sequences' unfinished prompts (chunked ones), then waiting
        requests, within the prefill limits. Nothing is preempted here: a prompt chunk that lacks blocks ends
        the step (scheduling nothing leaves it to the usual step, which preempts)."""
        budget = self.max_num_batched_tokens
        if self.max_prefill_tokens is not None:
            budget = min(budget, self.max_prefill_tokens)
        limit = self.max_prefill_seqs
        for seq in self.running:
            if budget <= 0 or (limit is not None and len(out.scheduled) >= limit):
                return
            if _decodes(seq):
                continue  # it waits for the next step
            num_new = min(seq.num_uncomputed, budget)
            if not self.block_manager.can_allocate(seq, num_new):
                return
            self.block_manager.allocate(seq, num_new)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        self._schedule_waiting(out, budget, limit)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed, budget)
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return budget
            self.block_manager.allocate(seq, num_new)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, max_seqs: int | None = None) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if max_seqs is not None and len(out.scheduled) >= max_seqs:
                return
            seq = self.waiting[0]
            if seq.seq_id in self.suspects and any(s.seq_id in self.suspects for s in self.running):
                return  # one suspect per batch
            hits = bm.lookup_prefix(seq)
            num_new = min(len(seq) - len(hits) * bm.block_size, budget)
            # The watermark keeps room for running sequences to grow; with none running it only blocks progress.
            if not bm.can_allocate(seq, num_new, hits, watermark=bool(self.running)):
                return
            self.waiting.popleft()
            bm.allocate(seq, num_new, hits)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def quarantine(self, seqs: list[Sequence], suspect: bool = True) -> None:
        """Preempt the running ``seqs`` of a failed step (their device state is unknown; they are recomputed)
        and, with ``suspect``, mark them as suspects until ``clear`` (FCFS order is kept)."""
        chosen = {seq.seq_id for seq in seqs}
        for seq in [s for s in reversed(self.running) if s.seq_id in chosen]:
            self.running.remove(seq)
            self._preempt(seq)
        if suspect:
            self.suspects.update(seq.seq_id for seq in seqs if not seq.is_finished)

    def clear(self, seq: Sequence) -> None:
        """``seq`` ran a step of its usual kind: no longer a suspect."""
        self.suspects.discard(seq.seq_id)

    # ---------------------------------------------------------------- what a step did (the sequences' state)
    def computed(self, scheduled: list[ScheduledSeq]) -> None:
        """A step (not a window) ran ``scheduled``: their tokens are in the KV cache, and full blocks join the
        prefix cache. A sampling sequence's last token is counted by ``accept``, with its sample."""
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens - item.samples
            self.block_manager.cache_full_blocks(item.seq)

    def accept(self, seq: Sequence, tokens, eos: int, ends: int | None = None) -> int:
        """Append ``seq``'s sampled tokens, [k, num_vq] ids (or ``Token``s) one row per step it ran, until
        ``eos`` (in any codebook: a text token repeats its id over them) or its length limit, and finish it
        there; every step counted computed its input token, the EOS step's included. ``ends``: the first row
        holding ``eos`` (k: none), where the caller found it already. Returns how many tokens were appended."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1, seq.tokens.width)
        if ends is None:
            ends = int(first_eos(tokens, eos))
        room = seq.max_tokens - len(seq)
        hit_eos = ends < min(len(tokens), room)  # an EOS past the length limit is never seen
        taken = ends if hit_eos else min(len(tokens), room)
        seq.num_computed_tokens += taken + hit_eos
        seq.extend(tokens[:taken])
        self.block_manager.cache_full_blocks(seq)
        if hit_eos:
            self.finish(seq, FinishReason.EOS)
        elif taken == room:  # the length asked for, or the context / KV cache first
            reached = seq.num_generated >= seq.params.max_new_tokens
            self.finish(seq, FinishReason.LENGTH if reached else FinishReason.CAPACITY)
        return taken

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq`` (EOS, length or abort) wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self.suspects.discard(seq.seq_id)
        seq.finish(reason)


def first_eos(tokens: np.ndarray, eos) -> np.ndarray:
    """The first step whose token holds ``eos`` in any codebook, the number of steps where none does: ``tokens``
    [..., num_steps, num_vq] (a window's sequences at once, or one sequence's rows), ``eos`` an id or one per
    leading index ([...], each sequence its mode's)."""
    hits = (tokens == np.asarray(eos)[..., None, None]).any(axis=-1)
    return np.where(hits.any(axis=-1), hits.argmax(axis=-1), tokens.shape[-2])


def _decodes(seq: Sequence) -> bool:
    """Its one uncomputed token is one it generated itself: a decode, what the multi-step decoder runs (else it
    has a prompt, or a preempted sequence's tokens, to compute)."""
    return seq.num_uncomputed == 1 and seq.num_generated > 0


def _is_decode(item: ScheduledSeq) -> bool:
    return item.num_new_tokens == 1 and _decodes(item.seq)
