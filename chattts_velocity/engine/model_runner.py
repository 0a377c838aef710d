"""``ModelRunner``: runs a scheduled step and hands back its tokens, one path for every kind of step.
``launch(plan)`` queues the step on the device and returns a ``Window``; ``collect(window)`` waits for its
tokens (and ``window.hidden`` holds the hidden state behind each). A decode step (every sequence decodes one
token it generated, all in one mode) runs as a window of ``plan.num_steps`` steps through the
``MultiStepDecoder`` (CUDA-graph replays), one step being a window of one; ``launch_next`` queues the same
batch's next window before the current one is read. Any other step (prompts, prompt chunks, recomputation,
decodes mixed in with them) turns into flat tensors, builds ChatTTS input embeddings (text ids, summed codes,
speaker vector), runs the Llama core over the paged KV cache and samples the sequences that reached their last
position: a window of one step whose tokens come back the same way.

On CUDA a prefill step (any step that is not one token per sequence) of up to ``PREFILL_SEQS[-1]`` sequences
and ``PREFILL_TOKENS[-1]`` tokens runs padded to the next bucket of both: the padding tokens belong to no
sequence and write no KV, the padding sequences are empty. Each bucket's core forward is a CUDA graph, so a
lone prompt's prefill no longer pays the host's ~200 kernel launches (`benchmarks/prefill_trace.py`: 9.2 ms
of host time against 0.75 ms on the device, H100, a 40-token prompt). Eager runs (``enforce_eager``) pad the
same way, so both compute the same shapes and give the same bits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..model.llama import AttentionMetadata, LlamaCore
from .decode import MultiStepDecoder
from .sampler import Sampler
from .scheduler import ScheduledSeq, SchedulerOutput
from .sequence import Sequence

logger = logging.getLogger(__name__)

PREFILL_TOKENS = (32, 64, 128, 256, 512)
PREFILL_SEQS = (1, 4, 16)


@dataclass
class Window:
    """A launched step (``ModelRunner.launch``): ``collect`` waits for its tokens."""

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


class ModelRunner:
    def __init__(self, gpt, core: LlamaCore, kv_caches: list[tuple[Tensor, Tensor]], block_size: int,
                 spk_emb_id: int, sampler: Sampler, device: torch.device, codes: tuple[Tensor, Tensor],
                 max_num_seqs: int, max_steps: int, max_model_len: int = 4096, use_cuda_graph: bool = False):
        self.gpt = gpt
        self.core = core
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.spk_emb_id = spk_emb_id
        self.sampler = sampler
        self.device = device
        self._code_table, self._code_offsets = codes  # ``Embed.fuse_code_tables``' (the decode windows' too)
        self.prefill: _PaddedPrefill | None = None
        if device.type == "cuda":
            self.prefill = _PaddedPrefill(core, kv_caches, -(-max_model_len // block_size), device)
            if use_cuda_graph:
                self.prefill.capture()
        self.decoder = MultiStepDecoder(gpt, core, kv_caches, sampler, codes, block_size, max_num_seqs, max_steps,
                                        max_model_len, device, use_cuda_graph)
        # Pinned host buffers, two (one window in flight while the previous one is read), flat: a window's
        # [K, n, Q] tokens go to a contiguous view of one. A pageable or non-contiguous destination (a [:K, :n]
        # slice of a [K_max, B_max, Q] buffer) makes torch copy through a pageable temporary, and so wait for
        # the window in flight: every launch of a batch smaller than max_num_seqs waited for its whole window
        # (py-spy of the server at 256 streams, H100), undoing the pipelining.
        size = max_steps * max_num_seqs * gpt.config.num_vq
        self._host_tokens = [torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
                             for _ in range(2)]
        self._next_host = 0

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
    def launch(self, plan: SchedulerOutput) -> Window:
        """Queue the scheduled step and return at once (see the module docstring)."""
        if plan.decode:
            seqs = [item.seq for item in plan.scheduled]
            return self._window(seqs, *self.decoder.run(seqs, plan.num_steps), decode=True)
        hidden, last_rows = self.forward(plan.scheduled)
        seqs = [item.seq for item in plan.scheduled if item.samples]
        hidden = hidden[last_rows].float()  # [S, H]
        tokens = self.sampler(hidden, seqs)  # [S, Q]
        return self._window(seqs, hidden[None], tokens[None], decode=False)

    @torch.inference_mode()
    def launch_next(self, window: Window, num_steps: int) -> Window:
        """Queue the next window of ``window``'s batch behind it, before its tokens are read: the decoder's
        device state already holds this window's inputs (``MultiStepDecoder.run``, ``continuing``)."""
        return self._window(window.seqs, *self.decoder.run(window.seqs, num_steps, continuing=True), decode=True)

    def _window(self, seqs: list[Sequence], hidden: Tensor, tokens: Tensor, decode: bool) -> Window:
        """``tokens`` [K, n, Q] on their way to a host buffer (not waited for) and ``hidden`` [K, n, H]."""
        k, n, q = tokens.shape
        host = self._host_tokens[self._next_host][: k * n * q].view(k, n, q)
        self._next_host ^= 1
        host.copy_(tokens, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Window(seqs, k, hidden, host, done, decode)

    def collect(self, window: Window) -> list[list[tuple[int, ...]]]:
        """Wait for ``window``; tokens[i][j] of sequence i at step j."""
        if window.done is not None:
            window.done.synchronize()
        # each sequence's codebook columns zipped into its tokens: zip builds the tuples in C (256 sequences x
        # 32 steps on the 2-core dev box: 5.5 ms against 14.6 for a tuple() per token)
        return [list(zip(*columns, strict=True)) for columns in window.tokens.numpy().transpose(1, 2, 0).tolist()]

    def _prepare(self, scheduled: list[ScheduledSeq]):
        """The step's flat inputs on the device: ids [N, num_vq], attention metadata, the rows of each sampling
        sequence's last token, and the embedding's row indices (text, audio, ``[spk_emb]``) with the speaker
        vectors. Built on the host and sent in two copies (one per integer width): each torch call on the
        engine thread lets go of the GIL and waits to take it back from a busy server's other threads, and a
        boolean mask or a pageable copy would also wait for the device."""
        bs, spk = self.block_size, self.spk_emb_id
        ids, positions, slots, cu, ctx, last_rows = [], [], [], [0], [], []
        text_rows, code_rows, spk_rows, speakers = [], [], [], []
        for item in scheduled:
            seq, start = item.seq, item.start
            end = start + item.num_new_tokens
            row, tokens = len(ids), seq.tokens[start:end]
            ids += tokens
            for j, text in enumerate(seq.is_text[start:end]):
                if not text:
                    code_rows.append(row + j)
                    continue
                text_rows.append(row + j)
                if seq.speaker is not None and tokens[j][0] == spk:
                    spk_rows.append(row + j)
                    speakers.append(seq.speaker)
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            cu.append(cu[-1] + item.num_new_tokens)
            ctx.append(end)
            if item.samples:
                last_rows.append(cu[-1] - 1)
        width = max(len(s.seq.block_table) for s in scheduled)
        tables = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in scheduled]
        n, q = len(ids), len(ids[0])
        wide = self._to_device(np.concatenate([np.array(ids, dtype=np.int64).reshape(-1), np.array(
            positions + slots + last_rows + text_rows + code_rows + spk_rows, dtype=np.int64)]))
        narrow = self._to_device(np.array(cu + ctx + [t for row in tables for t in row], dtype=np.int32))
        ids_t, wide = wide[: n * q].view(n, q), wide[n * q :]
        parts = wide.split([n, n, len(last_rows), len(text_rows), len(code_rows), len(spk_rows)])
        cu_t, ctx_t, tables_t = narrow.split([len(cu), len(ctx), len(tables) * width])
        meta = AttentionMetadata(positions=parts[0], slot_mapping=parts[1], cu_seqlens_q=cu_t, context_lens=ctx_t,
                                 block_tables=tables_t.view(len(tables), width), decode_only=cu[-1] == len(scheduled))
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


class _PaddedPrefill:
    """The padded prefill steps (see the module docstring): static input buffers sized for the largest bucket,
    and each bucket's CUDA graph once ``capture`` ran (eager on the same buffers before)."""

    def __init__(self, core: LlamaCore, kv_caches, table_width: int, device: torch.device):
        self.core, self.kv_caches = core, kv_caches
        tokens, seqs = PREFILL_TOKENS[-1], PREFILL_SEQS[-1]
        hidden = core.layers[0].o.size(0)

        def i32(*shape):
            return torch.zeros(shape, dtype=torch.int32, device=device)

        self.emb = torch.zeros(tokens, hidden, dtype=core.dtype, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.cu, self.ctx, self.tables = i32(seqs + 1), i32(seqs), i32(seqs, table_width)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}

    def fits(self, num_seqs: int, num_tokens: int) -> bool:
        return num_seqs <= PREFILL_SEQS[-1] and num_tokens <= PREFILL_TOKENS[-1]

    def _meta(self, seqs: int, tokens: int) -> AttentionMetadata:
        return AttentionMetadata(positions=self.positions[:tokens], slot_mapping=self.slots[:tokens],
                                 cu_seqlens_q=self.cu[: seqs + 1], context_lens=self.ctx[:seqs],
                                 block_tables=self.tables[:seqs], decode_only=False)

    def capture(self) -> None:
        pool = None
        for seqs in reversed(PREFILL_SEQS):
            for tokens in reversed(PREFILL_TOKENS):
                meta = self._meta(seqs, tokens)  # the buffers as built: every sequence empty, no KV written
                self.core.forward(self.emb[:tokens], meta, self.kv_caches)  # warm up (Triton, cuBLAS)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.core.forward(self.emb[:tokens], meta, self.kv_caches)
                pool = graph.pool()
                self.graphs[seqs, tokens] = graph, out
        torch.cuda.synchronize()
        logger.info("captured %d prefill CUDA graphs (up to %d sequences, %d tokens)", len(self.graphs),
                    PREFILL_SEQS[-1], PREFILL_TOKENS[-1])

    def __call__(self, emb: Tensor, meta: AttentionMetadata) -> Tensor:
        """``core.forward(emb, meta)`` padded to the bucket: hidden states [N, H] (a tensor of its own)."""
        n, s = emb.size(0), meta.context_lens.size(0)
        tokens = next(b for b in PREFILL_TOKENS if b >= n)
        seqs = next(b for b in PREFILL_SEQS if b >= s)
        self.emb[:n].copy_(emb)
        self.emb[n:tokens].zero_()
        self.positions[:n].copy_(meta.positions)
        self.positions[n:tokens].zero_()
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:tokens].fill_(-1)  # padding tokens write no KV
        self.cu[: s + 1].copy_(meta.cu_seqlens_q)
        self.cu[s + 1 : seqs + 1].fill_(n)  # padding sequences are empty
        self.ctx[:s].copy_(meta.context_lens)
        self.ctx[s:seqs].zero_()
        self.tables[:s, : meta.block_tables.size(1)].copy_(meta.block_tables)
        captured = self.graphs.get((seqs, tokens))
        if captured is None:
            out = self.core.forward(self.emb[:tokens], self._meta(seqs, tokens), self.kv_caches)
        else:
            captured[0].replay()
            out = captured[1]
        return out[:n].clone()  # the graph's output buffer is overwritten by the next replay
