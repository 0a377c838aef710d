"""``ModelRunner``: owns the device side (the Llama core in the engine's dtype, the paged KV cache sized from the
config and the device's memory, the sampler) and runs a scheduled step on it, one path for every kind of step.

``launch(plan)`` queues the step on the device and returns a ``LaunchedStep``; ``collect(step)`` waits for its
tokens (and ``step.hidden`` holds the hidden state behind each). A decode step (every sequence decodes one
token it generated, all in one mode) runs as a window of ``plan.num_steps`` steps through the
``MultiStepDecoder`` (CUDA-graph replays), one step being a window of one; ``launch_next`` queues the same
batch's next window before the current one is read. Any other step (prompts, prompt chunks, recomputation,
decodes mixed in with them) turns into flat tensors, builds ChatTTS input embeddings (text ids, summed codes,
speaker vector), runs the Llama core over the paged KV cache (padded to a captured bucket on CUDA:
``PaddedPrefill``) and samples the sequences that reached their last position: a window of one step whose
tokens come back the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..device import wait_for
from ..kernels.linear import CpuWeight
from ..model.llama import AttentionMetadata, LlamaCore
from ..timeline import traced
from .engine_config import EngineConfig
from .multi_step import MultiStepDecoder
from .prefill_graphs import PREFILL_SEQS, PREFILL_TOKENS, PaddedPrefill
from .sampler import Sampler
from .scheduler import ScheduledSeq, SchedulerOutput
from .sequence import Sequence

logger = logging.getLogger(__name__)

CPU_KV_GIB = 1.0
"""KV cache of an automatic size on CPU."""
GPU_KV_FRACTION = 0.4
"""Share of the free GPU memory an automatic KV cache takes."""


@dataclass
class LaunchedStep:
    """A step queued on the device (``ModelRunner.launch``): ``collect`` waits for its tokens."""

    seqs: list[Sequence]
    """The sequences that sample a token at each of its steps."""
    num_steps: int
    hidden: Tensor
    """[K, n, H] float32 on the device: the final-norm hidden state behind each token."""
    tokens: Tensor
    """[K, n, Q] int64, a contiguous view of the host buffer the tokens are copied into."""
    done: torch.cuda.Event | None
    """Recorded after that copy (CUDA); None on the CPU, where a launch is synchronous."""
    decode: bool
    """A decode window (``launch_next`` may queue the batch's next one behind it)."""
    launched_at: float = 0.0
    """``time.perf_counter()`` before it was launched (``LLMEngine`` times its steps from it)."""
    behind: bool = False
    """Queued behind another window, before that one's tokens were read (``launch_next``)."""
    started: torch.cuda.Event | None = None
    """Such a window's timing event on CUDA, recorded before its steps, so that it and ``done`` time the window
    on the device (``device_s``); None otherwise."""

    def device_s(self) -> float | None:
        """Seconds the window ran on the device, from ``started`` to ``done`` (once ``done`` has passed); None
        without ``started``."""
        if self.started is None or self.done is None:
            return None
        return self.started.elapsed_time(self.done) / 1e3


@dataclass
class OpenWindow:
    """A decode window queued a few steps at a time (``ModelRunner.open``); ``ModelRunner.close`` queues the
    rest, or ends it early, and gives the ``LaunchedStep``."""

    seqs: list[Sequence]
    planned: int
    """Steps the scheduler granted it (the blocks it reserved)."""
    launched_at: float = 0.0
    """As ``LaunchedStep.launched_at``; ``close`` passes it on."""
    queued: int = 0
    """Steps queued so far (on CUDA each followed by ``ModelRunner``'s event of that step)."""


class ModelRunner:
    def __init__(self, gpt, config: EngineConfig, spk_emb_id: int, text_eos_id: int, device: torch.device):
        gcfg = gpt.config
        self.gpt = gpt
        self.device = device
        self.block_size = config.block_size
        self.spk_emb_id = spk_emb_id
        gpt.ensure_llama()  # (an engine built again over a model whose reference weights were let go)
        dtype, weights = config.core_format(device)
        self.core = LlamaCore(gpt.llama, dtype, device, weights)
        self.num_blocks = num_kv_blocks(config, gcfg, device)
        self.kv_caches = _allocate_kv(self.num_blocks, config, gcfg, device)
        if weights is None:
            self.sampler = Sampler(gpt.embed, gcfg.num_vq, gcfg.eos_code, text_eos_id,
                                   half_core=dtype == torch.float16)
        else:
            self.sampler = CpuHeadSampler(gpt.embed, gcfg.num_vq, gcfg.eos_code, text_eos_id, weights)
        use_graphs = device.type == "cuda" and not config.enforce_eager
        with torch.no_grad():  # the audio codes' embedding table, one for the prefill steps and the windows
            codes = gpt.embed.fuse_code_tables()  # [Q * V, H], [Q]
        self._code_table, self._code_offsets = codes
        max_model_len, max_seqs, max_steps = gcfg.max_position_embeddings, config.max_num_seqs, config.decode_steps_cap
        self.prefill: PaddedPrefill | None = None
        if device.type == "cuda":
            self.prefill = PaddedPrefill(self.core, self.kv_caches, -(-max_model_len // self.block_size), device)
            if use_graphs:
                self.prefill.capture()
        self.decoder = MultiStepDecoder(gpt, self.core, self.kv_caches, self.sampler, codes, self.block_size,
                                        max_seqs, max_steps, max_model_len, device, use_graphs)
        # Pinned host buffers, two (one window in flight while the previous one is read), flat: a window's
        # [K, n, Q] tokens go to a contiguous view of one. A pageable or non-contiguous destination (a [:K, :n]
        # slice of a [K_max, B_max, Q] buffer) makes torch copy through a pageable temporary, and so wait for
        # the window in flight: every launch of a batch smaller than max_num_seqs waited for its whole window
        # (seen in a profile of the server under load), undoing the pipelining.
        size = max_steps * max_seqs * gcfg.num_vq
        self._host_tokens = [torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
                             for _ in range(2)]
        self._next_host = 0
        self._step_events = [torch.cuda.Event() for _ in range(max_steps)] if device.type == "cuda" else []
        """Recorded after each step of an ``OpenWindow`` (one window is open at a time); none on the CPU, where a
        step runs as it is queued."""

    def prefill_limits(self) -> tuple[int | None, int | None]:
        """Most sequences and tokens of a step the padded prefill (a CUDA graph) takes; (None, None) on CPU."""
        return (PREFILL_SEQS[-1], PREFILL_TOKENS[-1]) if self.prefill is not None else (None, None)

    @torch.inference_mode()
    def forward(self, scheduled: list[ScheduledSeq]) -> tuple[Tensor, Tensor]:
        """Run the scheduled tokens through the core (writing their K/V): hidden states [N, H] (core dtype) and
        the rows [S] of each sampling sequence's last token."""
        ids, meta, last_rows, rows = self._prepare(scheduled)
        emb = self._embed(ids, rows)  # [N, H]
        if self.prefill is not None and not meta.decode_only and self.prefill.fits(len(scheduled), emb.size(0)):
            return self.prefill(emb, meta), last_rows
        return self.core.forward(emb, meta, self.kv_caches), last_rows

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput) -> LaunchedStep:
        """Queue the scheduled step and return at once (see the module docstring)."""
        if plan.decode:
            seqs = [item.seq for item in plan.scheduled]
            return self._launched(seqs, *self.decoder.run(seqs, plan.num_steps), decode=True)
        hidden, last_rows = self.forward(plan.scheduled)
        seqs = [item.seq for item in plan.scheduled if item.samples]
        hidden = hidden[last_rows].float()  # [S, H]
        tokens = self.sampler(hidden, seqs)  # [S, Q]
        return self._launched(seqs, hidden[None], tokens[None], decode=False)

    @torch.inference_mode()
    def launch_next(self, step: LaunchedStep, num_steps: int, lead: int | None = None) -> LaunchedStep | OpenWindow:
        """Queue the next window of ``step``'s batch behind it, before its tokens are read: the decoder's
        device state already holds this window's inputs (``MultiStepDecoder.run``, ``continuing``).
        ``lead``: only its first ``lead`` steps, as ``open`` does."""
        if lead is not None and lead < num_steps:
            return self._open(step.seqs, num_steps, lead, continuing=True)
        started = None
        if self.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        window = self._launched(step.seqs, *self.decoder.run(step.seqs, num_steps, continuing=True), decode=True,
                                started=started)
        window.behind = True
        return window

    def open(self, plan: SchedulerOutput, lead: int) -> LaunchedStep | OpenWindow:
        """Like ``launch`` for a decode window, but queue only its first ``lead`` steps: ``close`` queues the
        rest a few at a time and may end it before them, when a request arrives."""
        if not plan.decode or plan.num_steps <= lead:
            return self.launch(plan)
        return self._open([item.seq for item in plan.scheduled], plan.num_steps, lead, continuing=False)

    def _open(self, seqs: list[Sequence], planned: int, lead: int, continuing: bool) -> OpenWindow:
        self.decoder.begin(seqs, continuing)
        window = OpenWindow(seqs, planned)
        for _ in range(lead):
            self._queue(window)
        return window

    def _queue(self, window: OpenWindow) -> None:
        """Queue ``window``'s next step."""
        self.decoder.advance(1)
        if self._step_events:
            self._step_events[window.queued].record()
        window.queued += 1

    def close(self, window: OpenWindow, stop: Callable[[], bool], ahead: int) -> tuple[LaunchedStep, bool]:
        """Queue ``window``'s remaining steps, keeping at most ``ahead`` of them queued beyond the device's
        progress and asking ``stop()`` before each; when it says so, the window ends at the steps queued (its
        sequences keep the blocks reserved for the rest). The step to collect, and whether it ended early."""
        while window.queued < window.planned:
            if self._step_events and window.queued >= ahead:
                wait_for(self._step_events[window.queued - ahead])
            if stop():
                break
            self._queue(window)
        cut = window.queued < window.planned
        step = self._launched(window.seqs, *self.decoder.outputs(window.queued), decode=True)
        step.launched_at = window.launched_at
        return step, cut

    def _launched(self, seqs: list[Sequence], hidden: Tensor, tokens: Tensor, decode: bool,
                  started: torch.cuda.Event | None = None) -> LaunchedStep:
        """``tokens`` [K, n, Q] on their way to a host buffer (not waited for) and ``hidden`` [K, n, H];
        ``started``: see ``LaunchedStep``."""
        k, n, q = tokens.shape
        host = self._host_tokens[self._next_host][: k * n * q].view(k, n, q)
        self._next_host ^= 1
        host.copy_(tokens, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event(enable_timing=started is not None)
            done.record()
        return LaunchedStep(seqs, k, hidden, host, done, decode, started=started)

    @traced("wait for the device")
    def wait(self, step: LaunchedStep) -> None:
        """Wait until the device has computed ``step`` (and copied its tokens to the host)."""
        if step.done is not None:
            wait_for(step.done)

    @traced("read tokens", lambda a, k, r: {"steps": a[1].num_steps, "seqs": len(a[1].seqs)})
    def collect(self, step: LaunchedStep) -> np.ndarray:
        """Wait for ``step``; its tokens [num_seqs, num_steps, num_vq], tokens[i] the rows of sequence i (a view
        of the step's host buffer, read before that buffer's next use; hidden states: ``step.hidden``)."""
        self.wait(step)
        return step.tokens.numpy().transpose(1, 0, 2)

    def _prepare(self, scheduled: list[ScheduledSeq]):
        """The step's flat inputs on the device: ids [N, num_vq], attention metadata, the rows of each sampling
        sequence's last token, and the embedding's row indices (text, audio, ``[spk_emb]``) with the speaker
        vectors. Built on the host and sent in two copies (one per integer width): each torch call on the
        engine thread lets go of the GIL and waits to take it back from a busy server's other threads, and a
        boolean mask or a pageable copy would also wait for the device."""
        bs, spk = self.block_size, self.spk_emb_id
        num = len(scheduled)
        ids, text, starts, lengths, last_rows, speakers_at = [], [], [], [], [], []
        width = max(len(item.seq.block_table) for item in scheduled)
        tables = np.zeros((num, width), dtype=np.int32)
        # Python a sequence at a time, numpy over every token at once: a step of 256 prompts has ~10,000 tokens
        row = 0
        for i, item in enumerate(scheduled):
            seq, start, length = item.seq, item.start, item.num_new_tokens
            tables[i, : len(seq.block_table)] = seq.block_table
            ids.append(seq.tokens.rows(start, start + length))
            text += seq.is_text[start : start + length]
            if seq.speaker is not None:
                speakers_at.append((row, length, seq.speaker))
            starts.append(start)
            lengths.append(length)
            row += length
            if item.samples:
                last_rows.append(row - 1)
        ids, text = np.concatenate(ids), np.array(text, dtype=bool)
        lengths = np.array(lengths, dtype=np.int64)
        ctx = np.array(starts, dtype=np.int64) + lengths
        cu = np.concatenate([[0], np.cumsum(lengths)])
        seq_of = np.repeat(np.arange(num), lengths)  # each token's sequence
        positions = np.arange(row) - np.repeat(cu[:-1] - starts, lengths)
        slots = tables[seq_of, positions // bs].astype(np.int64) * bs + positions % bs
        text_rows, code_rows = np.flatnonzero(text), np.flatnonzero(~text)
        spk_rows, speakers = [], []
        for at, length, speaker in speakers_at:  # ``[spk_emb]`` text positions of the sequences with a speaker
            found = at + np.flatnonzero(text[at : at + length] & (ids[at : at + length, 0] == spk))
            spk_rows += found.tolist()
            speakers += [speaker] * len(found)
        n, q = ids.shape
        wide = self._to_device(np.concatenate([ids.reshape(-1), positions, slots, np.array(last_rows, np.int64),
                                               text_rows, code_rows, np.array(spk_rows, np.int64)], dtype=np.int64))
        narrow = self._to_device(np.concatenate([cu, ctx, tables.reshape(-1)], dtype=np.int32, casting="same_kind"))
        ids_t, wide = wide[: n * q].view(n, q), wide[n * q :]
        parts = wide.split([n, n, len(last_rows), len(text_rows), len(code_rows), len(spk_rows)])
        cu_t, ctx_t, tables_t = narrow.split([len(cu), len(ctx), num * width])
        meta = AttentionMetadata(positions=parts[0], slot_mapping=parts[1], cu_seqlens_q=cu_t, context_lens=ctx_t,
                                 block_tables=tables_t.view(num, width), decode_only=row == num)
        speakers_t = None
        if speakers:
            speakers_t = torch.stack(speakers)
            if self.device.type == "cuda":
                speakers_t = speakers_t.pin_memory().to(self.device, non_blocking=True)
        return ids_t, meta, parts[2], (parts[3], parts[4], parts[5], speakers_t)

    def _to_device(self, values: np.ndarray) -> Tensor:
        host = torch.from_numpy(values)
        if self.device.type != "cuda":
            return host
        # through torch's caching pinned allocator: the copy does not wait for the device, and the block is not
        # reused before the copy ran
        return host.pin_memory().to(self.device, non_blocking=True)

    def _embed(self, ids: Tensor, rows) -> Tensor:
        """[N, num_vq] ids -> [N, H] embeddings, ChatTTS-style, the speaker vector at ``[spk_emb]`` positions."""
        text_rows, code_rows, spk_rows, speakers = rows
        emb = self.gpt.embed.embed_rows(ids, text_rows, code_rows, self._code_table, self._code_offsets)
        if speakers is not None:
            emb[spk_rows] = speakers.to(emb.dtype)
        return emb


class CpuHeadSampler(Sampler):
    """A ``Sampler`` whose code and text heads are ``CpuWeight``s of the engine's CPU weight format (a full-size
    text head is as large as three layers)."""

    def __init__(self, embed, num_vq: int, code_eos: int, text_eos: int, weights: str):
        super().__init__(embed, num_vq, code_eos, text_eos)
        self.code_head = CpuWeight(self.code_head, weights)  # [Q * V, H]
        self.text_head = CpuWeight(self.text_head, weights)  # [V_text, H]

    def code_logits(self, hidden: Tensor, core_out: Tensor | None = None) -> Tensor:
        return self.code_head(hidden).view(hidden.size(0) * self.num_vq, -1)

    def text_logits(self, hidden: Tensor) -> Tensor:
        return self.text_head(hidden)


def kv_block_bytes(config: EngineConfig, gcfg, device: torch.device) -> int:
    """Bytes of one KV block over every layer (keys and values) on ``device``."""
    per_token = 2 * gcfg.num_hidden_layers * gcfg.num_key_value_heads * (gcfg.hidden_size // gcfg.num_attention_heads)
    dtype, _ = config.core_format(device)
    return per_token * config.block_size * torch.empty(0, dtype=dtype).element_size()


def num_kv_blocks(config: EngineConfig, gcfg, device: torch.device) -> int:
    """The KV cache's blocks: ``num_kv_blocks``, else what ``kv_cache_gib`` (or the automatic budget) holds."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_gib is not None:
        budget = config.kv_cache_gib * 2**30
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * GPU_KV_FRACTION
    else:
        budget = CPU_KV_GIB * 2**30
    blocks = int(budget // kv_block_bytes(config, gcfg, device))
    if config.kv_cache_gib is None:  # automatic size: no more than max_num_seqs full contexts
        per_seq = -(-gcfg.max_position_embeddings // config.block_size)
        blocks = min(blocks, config.max_num_seqs * per_seq)
    if blocks < 1:
        raise ValueError(f"kv_cache_gib={config.kv_cache_gib} holds no KV block; give more memory")
    return blocks


def _allocate_kv(num_blocks: int, config: EngineConfig, gcfg, device: torch.device) -> list[tuple[Tensor, Tensor]]:
    """One (keys, values) pair of [blocks, block_size, kv_heads, head_dim] per layer."""
    head_dim = gcfg.hidden_size // gcfg.num_attention_heads
    shape = (num_blocks, config.block_size, gcfg.num_key_value_heads, head_dim)
    dtype, _ = config.core_format(device)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(gcfg.num_hidden_layers)]
    logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s)", num_blocks, config.block_size,
                num_blocks * kv_block_bytes(config, gcfg, device) / 2**30, str(dtype).removeprefix("torch."))
    return caches
