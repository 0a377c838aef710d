"""``LLMEngine``: requests in, tokens out, one ``step`` at a time. Each step schedules a batch (decodes and
prefill chunks of any mix of requests and parameters), runs it, samples, and reports every request that
advanced, so streaming consumers follow each request incrementally.

A step that raises fails only the requests it concerns: a failing batch of one fails that request; a larger
one is quarantined (see ``Scheduler.quarantine``) and re-run with one suspect per batch, so the request whose
presence breaks steps is failed alone (its output carries the error) while the engine serves the rest."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..device import wait_for
from ..timeline import traced
from .block_manager import BlockSpaceManager
from .engine_config import EngineConfig
from .model_runner import LaunchedStep, ModelRunner, OpenWindow
from .prefill_graphs import PREFILL_TOKENS
from .sampling_params import SamplingParams
from .scheduler import Scheduler, first_eos
from .sequence import FinishReason, Prompt, RequestOutput, Sequence
from .timings import Timings
from .validation import check_prompt, float32_host, validate_request

logger = logging.getLogger(__name__)

CPU_BATCHED_TOKENS = 2048
"""``EngineConfig.max_num_batched_tokens``'s default on the CPU (on CUDA: the prefill graphs' most tokens)."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load and totals (for metrics)."""

    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    num_steps: int
    """Scheduler calls that ran a batch."""
    num_prompt_tokens: int
    """Prompt tokens computed (prefix-cache hits and recomputation after preemption included)."""
    num_generated_tokens: int
    max_batch_size: int
    """Most sequences computed together in one step so far."""
    num_failed: int
    """Requests failed by a step error."""
    num_prompt_steps: int = 0
    """Steps read that computed prompts (a step with any prompt tokens; its decode rows ride along)."""
    num_windows: int = 0
    """Decode windows read: each a graph replay per step, then one read of its tokens by the host."""
    num_window_steps: int = 0
    """Their steps: ``num_window_steps / num_windows`` is the mean window, the host's turn per so many steps."""
    num_window_tokens: int = 0
    """Their steps times their sequences: over ``num_window_steps``, the mean decode batch."""
    abort_wait: Timings | None = None
    """From an abort asked of ``AsyncLLMEngine`` to its blocks freed (set by ``AsyncLLMEngine.stats``)."""
    loop_time: Timings | None = None
    """One turn of ``AsyncLLMEngine``'s loop: a step and the audio round after it (set likewise); an abort
    waits at most the turn it arrives in."""
    first_token_wait: Timings | None = None
    """A request, from submitted to its first token reported: the wait for the step or window running when it
    came, and its prompt step (set likewise)."""
    first_audio_wait: Timings | None = None
    """A streamed request, from its first token to its first audio: its first window and the audio round that
    decodes it (set likewise)."""
    first_decode_wait: Timings | None = None
    """The audio's part of ``first_audio_wait``: from the request's first audio's tokens reaching the audio
    pump (``RequestTimes.audio_ready``) to its first audio (set likewise)."""
    thread_time: dict[str, float] | None = None
    """Seconds the engine thread has spent in each of ``timings.THREAD_PARTS`` since it began (set likewise):
    over an interval, whether the engine waited for the device (device-bound) or the device for the host."""


def _describe_step(step: LaunchedStep | OpenWindow | None) -> dict | None:
    """A launched step as a timeline span's arguments (``timeline.traced``)."""
    if step is None:
        return None
    if isinstance(step, OpenWindow):
        return {"kind": "open decode window", "planned steps": step.planned, "seqs": len(step.seqs)}
    return {"kind": "decode window" if step.decode else "prompt step", "steps": step.num_steps,
            "seqs": len(step.seqs)}


class LLMEngine:
    def __init__(self, gpt, config: EngineConfig, spk_emb_id: int, text_eos_id: int,
                 device: torch.device | str = "cpu"):
        self.config = config
        self.model_config = gpt.config
        self.text_eos_id = text_eos_id
        self.runner = ModelRunner(gpt, config, spk_emb_id, text_eos_id, torch.device(device))
        self.block_manager = BlockSpaceManager(self.runner.num_blocks, config.block_size, config.watermark,
                                               config.enable_prefix_caching)
        cuda = self.runner.device.type == "cuda"
        prefill_first = cuda if config.prefill_first is None else config.prefill_first
        seqs, tokens = self.runner.prefill_limits() if prefill_first else (None, None)
        batched_tokens = config.max_num_batched_tokens or (PREFILL_TOKENS[-1] if cuda else CPU_BATCHED_TOKENS)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, batched_tokens,
                                   config.num_decode_steps, config.window_stops, config.max_window_tokens,
                                   prefill_first, seqs, tokens, config.window_stop_budget_ms,
                                   config.window_budget_ms, config.decode_steps_cap)
        self._collected_at = 0.0
        """``time.perf_counter()`` when the latest step's tokens were read (``_time_steps``)."""
        self._waited = 0.0
        """Seconds the latest step waited for the device to read its window: the window queued behind it was
        launched before, so that wait is no host work of the gap ``_fit_window`` measures."""
        self.requests: dict[str, Sequence] = {}
        """The unfinished requests' sequences, by request id."""
        self._aborted: list[RequestOutput] = []
        pipeline = config.pipeline_decode
        self._pipeline = cuda if pipeline is None else pipeline
        self._window: LaunchedStep | OpenWindow | None = None
        """A decode window queued on the device (or a step launched ahead) whose tokens the next ``step``
        reads."""
        self._ahead_failure: Exception | None = None
        """What ``launch_ahead`` raised: the next ``step`` reports it as its own."""
        self.arrivals: Callable[[], bool] | None = None
        """Set by the engine's owner (``AsyncLLMEngine``): hands the requests submitted or aborted since it was
        last called to this engine, on the engine's thread, and says whether there were any. With it, the
        batch's next window is queued once the running one has ended and nobody new came during it, so a
        request that arrives during a window waits for that window only, not for one queued behind it too (the
        device waits meanwhile for the next window's launch, a graph replay). None: queued at once (offline
        use: nobody arrives)."""
        self._num_added = 0
        """Sequences added so far: a window open since fewer were added ends early (``_run_step``)."""
        self._open_mark = 0
        """``_num_added`` when the open window (an ``OpenWindow``) was launched."""
        self._ids = itertools.count()
        dev = self.runner.device
        self._report_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        """Where reports are built (see ``_reporting``)."""
        self._batch: list[Sequence] = []
        """The sequences of the step running now (those a failure concerns)."""
        self._totals = dict(num_steps=0, num_prompt_tokens=0, num_generated_tokens=0, max_batch_size=0,
                            num_failed=0, num_prompt_steps=0, num_windows=0, num_window_steps=0,
                            num_window_tokens=0)

    @classmethod
    def from_model(cls, model, config: EngineConfig | None = None, device: torch.device | str = "cpu") -> LLMEngine:
        """An engine over a loaded ChatTTS model (``ModelLoader.load``)."""
        tok = model.tokenizer
        return cls(model.gpt, config or EngineConfig(), tok.spk_emb_ids, tok.eos_token, device)

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_position_embeddings

    @property
    def kv_capacity(self) -> int:
        """Tokens the whole KV cache holds: the longest sequence (prompt + output) it can serve."""
        return self.block_manager.num_blocks * self.block_manager.block_size

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        """Queue a request; raises ``ValueError`` (and changes nothing) if it can never be served."""
        self.add_sequence(self.make_sequence(request_id, prompt, params))

    def make_sequence(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Sequence:
        """Validate a request (``ValueError`` says what to fix) and build its sequence, without queueing it.
        Reads only fixed sizes, so any thread may call it while another steps the engine."""
        tokens, is_text = self.validate_request(prompt, params)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        return self._sequence(next(self._ids), request_id, tokens, is_text, prompt.speaker, params, seed)

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence from ``make_sequence`` (on the thread that steps the engine)."""
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        self._num_added += 1

    def _sequence(self, seq_id, request_id, tokens, is_text, speaker, params, seed) -> Sequence:
        capacity = self.kv_capacity
        speaker = None if speaker is None else float32_host(speaker)
        speaker_key = b"" if speaker is None else hashlib.blake2b(speaker.numpy().tobytes(), digest_size=16).digest()
        max_tokens = min(len(tokens) + params.max_new_tokens, self.max_model_len, capacity)
        return Sequence(seq_id, request_id, tokens, is_text, speaker, speaker_key, params, seed, max_tokens)

    def num_cached_prompt_tokens(self, prompt: Prompt) -> int:
        """How many leading tokens of ``prompt`` the prefix cache holds now (what admitting it would reuse).
        A pure query: it draws no id and no seed."""
        tokens, is_text = check_prompt(self.model_config, prompt)
        seq = self._sequence(-1, "", tokens, is_text, prompt.speaker, SamplingParams(), 0)
        return len(self.block_manager.lookup_prefix(seq)) * self.block_manager.block_size

    def validate_request(self, prompt: Prompt, params: SamplingParams) -> tuple[list[tuple[int, ...]], list[bool]]:
        """Raise ``ValueError`` saying what to fix if the request can never be served; else its tokens."""
        return validate_request(self.model_config, self.kv_capacity, prompt, params)

    def abort_request(self, request_id: str, report: bool = True) -> bool:
        """Stop a request now and free its blocks; unless ``report`` is False, the next ``step`` reports it
        finished with ``abort``. Returns False if the request is unknown or already finished."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        if report:
            with self._reporting():
                self._aborted.append(self._output(seq))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    # ---------------------------------------------------------------- the loop
    @traced("engine step", lambda a, k, r: {"outputs": len(r)})
    def step(self) -> list[RequestOutput]:
        """Run one batch; report every request that sampled a token, finished or was aborted since.

        Audio decode windows are pipelined: while the batch stays the same (nobody waiting, nobody finished),
        the next window is queued on the device before this one's tokens are read back and processed, so the
        host work overlaps the device's."""
        outputs, self._aborted = self._aborted, []
        try:
            sampled = self._run_step()
        except Exception as err:  # noqa: BLE001 - any failure of a step is reported to its requests
            return outputs + self._recover(err)
        finally:
            self._batch = []
        with self._reporting():
            for seq in sampled:
                outputs.append(self._output(seq))
                if seq.is_finished:
                    del self.requests[seq.request_id]
        return outputs

    @contextlib.contextmanager
    def _reporting(self):
        """Build reports on a stream of their own and wait for it: what they gather (hidden states of windows
        already collected) is complete, so the wait costs only the gathering, whereas on the engine's stream it
        would queue behind the next window. A report's tensors are then ready on any stream or thread."""
        stream = self._report_stream
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield
        wait_for(stream)

    @traced("launch ahead", lambda a, k, r: {"launched": r})
    def launch_ahead(self, first_audio: bool | None = None) -> bool:
        """Launch the next step now, when nothing is queued and it brings sequences to their first audio
        (``Scheduler.before_first_audio``: prompts, a short first window): the device computes it while the
        caller does host work (the audio round of the step before, during which a step launched after it waited:
        `chattts-velocity bench stream`; docs/perf/), and the next ``step`` reads it. Only where windows are
        pipelined (``EngineConfig.pipeline_decode``: CUDA). ``first_audio``: ``before_first_audio()`` if the
        caller has it already. Whether it launched one."""
        if not self._pipeline or self._window is not None:
            return False
        if not (self.scheduler.before_first_audio() if first_audio is None else first_audio):
            return False
        try:
            self._window = self._launch()
        except Exception as err:  # noqa: BLE001 - the next step reports it, as if it had failed there
            self._ahead_failure = err
            return True
        return self._window is not None

    @traced("launch", lambda a, k, r: _describe_step(r))
    def _launch(self, may_open: bool = False) -> LaunchedStep | OpenWindow | None:
        """Schedule a step and launch it (None: nothing to run); ``may_open``: a decode window that may run open
        does (``_runs_open``)."""
        self._batch = []
        plan = self.scheduler.schedule()
        self._batch = [item.seq for item in plan.scheduled]
        if not plan.scheduled:
            return None
        self._count(plan)
        now = time.perf_counter()
        if may_open and plan.decode and self._runs_open(self._batch):
            self._open_mark = self._num_added
            window = self.runner.open(plan, self.config.window_lookahead)
        else:
            window = self.runner.launch(plan)
            if not window.decode:  # a decode's one token is counted with its sample (``Scheduler.accept``)
                self.scheduler.computed(plan.scheduled)
        window.launched_at = now
        return window

    def _run_step(self) -> list[Sequence]:
        """Schedule and launch one step (or take the window queued behind the last one, or launched ahead),
        queue the batch's next window behind a decode window when the scheduler grants it, and hand the step's
        tokens to the scheduler: the sequences that sampled tokens."""
        if self._ahead_failure is not None:  # ``_batch`` is still the batch it failed on
            err, self._ahead_failure = self._ahead_failure, None
            raise err
        ready_at = time.perf_counter()
        window, self._window = self._window, None
        if window is None:
            window = self._launch(may_open=True)
            if window is None:
                return []
        else:
            self._batch = list(window.seqs)
        cut = False
        if isinstance(window, OpenWindow):
            window, cut = self.runner.close(window, self._arrived, self.config.window_lookahead)
        if window.decode and not cut:
            self._window = self._continue(window)
        waiting_from = time.perf_counter()
        self.runner.wait(window)
        waited, self._waited = self._waited, time.perf_counter() - waiting_from
        tokens = self.runner.collect(window)
        self._count_read(window)
        self._time_steps(window)
        self._fit_window(window, ready_at - window.launched_at - waited)
        sampled = []
        ends = self._eos_rows(window.seqs, tokens)
        for seq, seq_tokens, seq_hidden, end in zip(window.seqs, tokens, window.hidden.unbind(1), ends, strict=True):
            if not seq.is_finished:  # not aborted while its window ran
                sampled.append(seq)
                self._accept(seq, seq_tokens, seq_hidden, end)
                if window.decode:  # a sequence's usual step: it is no longer a suspect
                    self.scheduler.clear(seq)
        return sampled

    def _time_steps(self, window: LaunchedStep) -> None:
        """Give the scheduler the step time of a decode window whose tokens were just read: from its launch, or
        from the previous window's read where it was queued behind that window (``Scheduler.step_s``)."""
        now = time.perf_counter()
        if window.decode and window.num_steps > 1:
            self.scheduler.step_s = (now - max(window.launched_at, self._collected_at)) / window.num_steps
        self._collected_at = now

    def _fit_window(self, window: LaunchedStep, host_s: float) -> None:
        """A window queued behind another (``LaunchedStep.behind``) was read: the host worked ``host_s`` between
        its launch and its read (waits for the device left out), against its time on the device, and the
        scheduler sizes the next full windows to that (``Scheduler.fit_window``)."""
        if not window.behind or window.num_steps < 2:
            return
        device_s = window.device_s()
        if device_s is not None:
            self.scheduler.fit_window(window.num_steps, device_s, host_s, len(window.seqs))

    def _count_read(self, window: LaunchedStep) -> None:
        """A step read: a prompt step, or a decode window of its steps and sequences (``EngineStats``)."""
        t = self._totals
        if not window.decode:
            t["num_prompt_steps"] += 1
            return
        t["num_windows"] += 1
        t["num_window_steps"] += window.num_steps
        t["num_window_tokens"] += window.num_steps * len(window.seqs)

    def _count(self, plan) -> None:
        t = self._totals
        t["num_steps"] += 1
        t["max_batch_size"] = max(t["max_batch_size"], len(plan.scheduled))
        t["num_prompt_tokens"] += sum(item.num_new_tokens for item in plan.scheduled if item.seq.num_generated == 0)

    def _recover(self, err: Exception) -> list[RequestOutput]:
        """After a failed step: a batch of one, or the one suspect of a batch, is failed; the rest of a batch
        with a suspect is recomputed; a batch without one is quarantined. Drops any window in flight."""
        self._window = None
        live = [seq for seq in self._batch if not seq.is_finished]
        if not live:  # not a batch's failure (e.g. in the scheduler): nothing to isolate
            raise err
        suspects = [seq for seq in live if seq.seq_id in self.scheduler.suspects]
        culprits = suspects if suspects else live if len(live) == 1 else []
        logger.warning("a step of %d sequences failed (%r); %s", len(live), err,
                       "failing request " + culprits[0].request_id if culprits else "isolating them")
        others = [seq for seq in live if seq not in culprits]
        self.scheduler.quarantine(others, suspect=not culprits)
        outputs = []
        with self._reporting():
            for seq in culprits:
                del self.requests[seq.request_id]
                self.scheduler.finish(seq, FinishReason.ERROR)
                self._totals["num_failed"] += 1
                out = self._output(seq)
                out.error = err
                outputs.append(out)
        return outputs

    def stats(self) -> EngineStats:
        """Load and totals now (call it on the thread that steps the engine)."""
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(num_waiting=len(sched.waiting), num_running=len(sched.running),
                           kv_blocks_used=bm.num_blocks - bm.num_free_blocks, kv_blocks_total=bm.num_blocks,
                           num_preemptions=sched.num_preemptions, **self._totals)

    def _runs_open(self, seqs: list[Sequence]) -> bool:
        """Whether a decode window of ``seqs`` runs as an ``OpenWindow`` (``EngineConfig.open_window_max_seqs``):
        requests arrive while the engine runs (``arrivals``), windows are pipelined, and it is neither a batch of
        more than ``open_window_max_seqs`` nor one that ends at its youngest audio sequence's window stop (its
        first chunks: ``EngineConfig.window_stops``)."""
        if self.arrivals is None or not self._pipeline or len(seqs) > self.config.open_window_max_seqs:
            return False
        return self.scheduler.next_stop(seqs) is None

    def _arrived(self) -> bool:
        """Whether the open window should end now: a request arrived since it was launched (``arrivals``, asked
        here) and the scheduler has room for it."""
        self.arrivals()
        sched = self.scheduler
        return self._num_added != self._open_mark and len(sched.running) < sched.max_num_seqs

    @traced("queue next window", lambda a, k, r: _describe_step(r))
    def _continue(self, window: LaunchedStep) -> LaunchedStep | OpenWindow | None:
        """Queue the same batch's next window behind ``window`` when the scheduler grants it
        (``Scheduler.continue_window``: nothing can change the batch before it, and it reserved the blocks).
        A sequence that ends by EOS inside ``window`` computes the queued window in vain; its tokens are
        dropped and the pipeline stops there. With ``arrivals``, queued only after ``window`` ended, if nobody
        arrived meanwhile."""
        if not self._pipeline:
            return None
        steps = self.scheduler.continue_window(window.seqs, window.num_steps)
        if not steps:
            return None
        if self.arrivals is not None:  # its blocks stay reserved if an arrival changes the batch
            self.runner.wait(window)
            if self.arrivals():
                return None
        now = time.perf_counter()
        if self._runs_open(window.seqs):  # enough steps queued to cover the report and audio round before ``close``
            self._open_mark = self._num_added
            queued = self.runner.launch_next(window, steps, lead=2 * self.config.window_lookahead)
        else:
            queued = self.runner.launch_next(window, steps)
        queued.launched_at = now
        return queued

    def _eos_rows(self, seqs: list[Sequence], tokens: np.ndarray) -> list[int]:
        """Each sequence's first row of ``tokens`` [num_seqs, num_steps, num_vq] holding its EOS (text or audio,
        by its mode), ``num_steps`` where none does (``first_eos``): the whole window in one pass."""
        eos = [self.text_eos_id if seq.text_mode else self.model_config.eos_code for seq in seqs]
        return first_eos(tokens, eos).tolist()

    def _accept(self, seq: Sequence, tokens: np.ndarray, hidden: torch.Tensor, end: int | None = None) -> None:
        """Hand sampled tokens [num_steps, num_vq] to the scheduler (which owns the sequence's state:
        ``Scheduler.accept``; ``end``: the row of their EOS, if found already); keep the hidden states of those
        it took."""
        eos = self.text_eos_id if seq.text_mode else self.model_config.eos_code
        taken = self.scheduler.accept(seq, tokens, eos, end)
        self._totals["num_generated_tokens"] += taken
        if taken and seq.params.return_hidden_states:
            seq.hidden_chunks.append(hidden if taken == hidden.shape[0] else hidden[:taken])

    def _output(self, seq: Sequence) -> RequestOutput:
        start, seq.num_reported = seq.num_reported, seq.num_generated
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.output_ids(start),
            new_hidden_states=seq.output_hidden(self.model_config.hidden_size, start),
            num_generated=seq.num_generated,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
        )
        if seq.is_finished:
            out.token_ids = seq.output_ids()
            out.hidden_states = seq.output_hidden(self.model_config.hidden_size)
        return out
