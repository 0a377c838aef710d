"""``MultiStepDecoder``: several decode steps of a code-mode batch per scheduler call, with no host work
between them: the next step's inputs (tokens, positions, cache slots, penalty window, step counters) are
updated on the device, every step's tokens and hidden states land in device buffers, and the host reads the
tokens once per window. On CUDA each batch-size bucket's step is captured as a CUDA graph and replayed.
``run`` queues a window and returns its device outputs (``ModelRunner`` brings the tokens to the host), so
the engine can queue the same batch's next window (``run(..., continuing=True)``) before it reads the
current one. Every decode step of the engine runs here, a lone step as a window of one.

A sequence that ends inside the window (EOS, its length limit) keeps computing until the window ends; the host
drops those tokens, and the steps past its limit write no KV (their slot is -1).

Text (refine) batches run in windows too, with CUDA graphs of their own: one sampling row a sequence, the text
embedding and head, the text EOS; each token repeats its id over the codebooks, as the single-step path
reports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import kernels
from ..kernels.sampling_cpu import WindowSampler
from ..model.llama import AttentionMetadata, LlamaCore
from ..sampling.limits import MAX_PENALTY_WINDOW
from .sampler import RowParams, Sampler, row_params, sample_rows
from .sequence import Sequence

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


@dataclass
class _DecodeBuffers:
    """Static device buffers of the step (graph inputs and outputs), sized for the largest bucket."""

    tokens: Tensor  # [B, Q] int64: each row's newest token (this step's input)
    positions: Tensor  # [B] int64: its position
    limit: Tensor  # [B] int64: positions >= limit write no KV
    block_tables: Tensor  # [B, max_blocks] int32
    params: RowParams  # [B*Q] rows
    step_out: Tensor  # [] int64: which output row this step writes
    out_tokens: Tensor  # [K, B, Q] int64
    out_hidden: Tensor  # [K, B, H] float32
    split_counters: Tensor  # [B * heads] int32 zeros: the decode attention's in-kernel merge of its splits


class MultiStepDecoder:
    def __init__(self, gpt, core: LlamaCore, kv_caches, sampler: Sampler, codes: tuple[Tensor, Tensor],
                 block_size: int, max_batch: int,
                 max_steps: int, max_model_len: int, device: torch.device, use_cuda_graph: bool):
        self.gpt, self.core, self.kv_caches, self.sampler = gpt, core, kv_caches, sampler
        self.block_size = block_size
        self.num_vq = gpt.config.num_vq
        self.eos = gpt.config.eos_code
        self.max_model_len = max_model_len
        self.max_steps = max_steps
        self.device = device
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.state = self._allocate(max_batch, gpt.config.hidden_size)
        # Pinned host buffers for the block tables, two (one window in flight while the next is queued): a copy
        # from pageable memory would make torch wait for the stream, i.e. for the window in flight, which would
        # undo the pipelining.
        width = -(-max_model_len // block_size)
        self._host_tables = [torch.zeros(max_batch, width, dtype=torch.int32, pin_memory=device.type == "cuda")
                             for _ in range(2)]
        self._next_table = 0
        self._window: tuple[int, int, bool] = (0, 0, False)
        """The loaded window's batch bucket, sequences and mode (``begin``)."""
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        """The captured step of each (batch bucket, text mode)."""
        self._code_table, self._code_offsets = codes  # ``Embed.fuse_code_tables``': [Q * V, H], [Q]
        self._code_vocab = gpt.embed.emb_code[0].num_embeddings
        self._text_table = gpt.embed.emb_text.weight.detach()  # [V_text, H]
        if use_cuda_graph:
            self._capture_all()

    # ---------------------------------------------------------------- buffers
    def _allocate(self, batch: int, hidden: int) -> _DecodeBuffers:
        dev, rows, q = self.device, batch * self.num_vq, self.num_vq
        width = -(-self.max_model_len // self.block_size)

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=dev)

        params = RowParams(
            temperature=torch.ones(rows, 1, device=dev), top_p=torch.ones(rows, 1, device=dev), top_k=zeros(rows),
            penalty=torch.ones(rows, 1, device=dev), history=zeros(rows, MAX_PENALTY_WINDOW) - 1,
            window=zeros(rows), min_new=zeros(rows), seed=zeros(rows), step=zeros(rows), lane=zeros(rows),
        )
        return _DecodeBuffers(tokens=zeros(batch, q), positions=zeros(batch), limit=zeros(batch),
                      block_tables=zeros(batch, width, dtype=torch.int32), params=params,
                      step_out=torch.zeros((), dtype=torch.int64, device=dev), out_tokens=zeros(self.max_steps, batch, q),
                      out_hidden=torch.zeros(self.max_steps, batch, hidden, device=dev),
                      split_counters=zeros(batch * self.core.num_heads, dtype=torch.int32))

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    # ---------------------------------------------------------------- one step (captured or eager)
    def _step(self, b: int, text: bool = False) -> None:
        s, q = self.state, self.num_vq
        rows = b if text else b * q
        p = s.params
        # one launch each for what the step does around the layers (embedding, slots, state updates)
        table, vocab = (self._text_table, self._text_table.size(0)) if text else (self._code_table, self._code_vocab)
        emb, slots, rope_pos, context_lens = kernels.step_inputs(
            s.tokens[:b, :1] if text else s.tokens[:b], table, vocab, s.positions[:b], s.limit[:b],
            s.block_tables[:b], self.block_size, self.max_model_len, self.core.dtype)
        meta = AttentionMetadata(positions=rope_pos, slot_mapping=slots, cu_seqlens_q=s.positions[:0],
                                 context_lens=context_lens, block_tables=s.block_tables[:b], decode_only=True,
                                 split_counters=s.split_counters)
        out = self.core.forward(emb, meta, self.kv_caches)
        hidden = out.float()  # [b, H]
        if text:
            tok = sample_rows(self.sampler.text_logits(hidden), p.rows(rows), self.sampler.text_eos)  # [b]
            step_tokens = tok[:, None].expand(b, q)
        else:
            if b == 1 and hidden.is_cuda:  # the one-row GEMV (a few columns a program) beats cuBLAS's gemv there
                logits = kernels.fused_linear(hidden, self.sampler.code_head).view(q, -1)
            else:
                logits = self.sampler.code_logits(hidden, out)  # [b*Q, V]
            tok = sample_rows(logits, p.rows(rows), self.eos)  # [b*Q]
            step_tokens = tok.view(b, q)
        kernels.step_outputs(step_tokens, tok, hidden, s.out_tokens, s.out_hidden, s.step_out, s.tokens,
                             p.history, p.step, s.positions)
        s.step_out += 1

    def _run_cpu(self, b: int, num_steps: int, text: bool = False) -> None:
        """``num_steps`` of ``_step``, bit for bit, as the CPU runs them: one op at a time, so every op counts.
        What the window does not change is computed once (positions and slots on the host, the attention's
        cache rows, the sampling constants), the penalty history slides through one buffer, and the device
        state is brought up to date at the end. ``text``: a refine batch, each step as the single-step path
        samples it (one row a sequence, the text head, the text EOS)."""
        s, q = self.state, self.num_vq
        rows = b if text else b * q
        p = s.params.rows(rows)
        start = int(s.step_out)  # steps of this window already run (``advance`` in parts)
        assert start + num_steps <= self.max_steps
        contexts = self.core.decode_window(*self._cpu_positions(b, num_steps), s.block_tables[:b], self.block_size)
        embed, width = self.gpt.embed, p.history.size(1)
        vocab = self.sampler.text_head.size(0) if text else self.sampler.code_head.size(0) // q
        sample = WindowSampler(p.temperature, p.top_p, p.top_k, p.penalty, p.window, p.min_new, p.seed, p.step,
                               p.lane, self.sampler.text_eos if text else self.eos, vocab, width, num_steps)
        history = torch.cat([p.history, torch.empty(rows, num_steps, dtype=torch.int64)], 1)  # [R, W + K]
        tok = s.tokens[:b]
        logits_of = self.sampler.text_logits if text else self.sampler.code_logits
        for j in range(num_steps):
            if text:
                emb = embed.emb_text(tok[:, 0])  # [b, H]
            else:
                emb = embed.embed_codes(tok, self._code_table, self._code_offsets)  # [b, H]
            hidden = self.core.forward(emb, contexts.context(j), self.kv_caches).float()  # [b, H]
            flat = sample(logits_of(hidden), history[:, j : j + width], j)  # [R]
            history[:, width + j] = flat
            tok = flat[:, None].expand(b, q) if text else flat.view(b, q)
            s.out_tokens[start + j, :b] = tok
            s.out_hidden[start + j, :b] = hidden
        s.tokens[:b] = tok
        p.history.copy_(history[:, num_steps:])
        p.step += num_steps
        s.positions[:b] += num_steps
        s.step_out.fill_(start + num_steps)

    def _cpu_positions(self, b: int, num_steps: int) -> tuple[list[list[int]], list[list[int]]]:
        """Each step's rotary positions and KV slots (as ``_step`` computes them), from the device state."""
        s, bs, last = self.state, self.block_size, self.max_model_len - 1
        tables, limits, first = s.block_tables[:b].tolist(), s.limit[:b].tolist(), s.positions[:b].tolist()
        width = len(tables[0])
        positions, slots = [], []
        for j in range(num_steps):
            pos = [p + j for p in first]
            positions.append([min(p, last) for p in pos])
            slots.append([t[min(p // bs, width - 1)] * bs + p % bs if p < lim else -1
                          for p, lim, t in zip(pos, limits, tables, strict=True)])
        return positions, slots

    def _capture_all(self) -> None:
        pool = None
        for text in (False, True):
            for b in reversed(self.buckets):
                self.state.step_out.zero_()
                self._step(b, text)  # warm up: Triton compiles, cuBLAS picks its kernels
                self.state.step_out.zero_()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._step(b, text)
                pool = graph.pool()
                self.graphs[b, text] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (audio and text, batch buckets up to %d)", len(self.graphs),
                    self.buckets[-1])

    # ---------------------------------------------------------------- a window of steps
    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_steps: int, continuing: bool = False) -> tuple[Tensor, Tensor]:
        """Queue ``num_steps`` decode steps of every sequence (each's newest token is its only uncomputed one):
        hidden states [K, n, H] (a tensor of its own) and tokens [K, n, Q] (a view of the output buffer, valid
        until the next window), not waited for. ``continuing``: the same batch right after its previous
        window, whose device state (tokens, positions, penalty history, step counters) already holds this
        window's inputs; only the block tables are refreshed, so the window can be queued before the host has
        read the previous one's tokens. ``begin``, ``advance`` and ``outputs`` do the same in parts: a window
        queued a few steps at a time, which may end before the steps it reserved (``ModelRunner.open``)."""
        self.begin(seqs, continuing)
        self.advance(num_steps)
        return self.outputs(num_steps)

    @torch.inference_mode()
    def begin(self, seqs: list[Sequence], continuing: bool = False) -> None:
        """Load a window's batch (see ``run``); no step is queued yet."""
        assert 1 <= len(seqs) <= self.buckets[-1]
        text = seqs[0].text_mode
        b = self._bucket(len(seqs))
        if continuing:
            self._load_tables(seqs, b)
            self.state.step_out.zero_()
        else:
            self._load(seqs, b, 1 if text else self.num_vq)
        self._window = (b, len(seqs), text)

    @torch.inference_mode()
    def advance(self, num_steps: int) -> None:
        """Queue ``num_steps`` more steps of the window ``begin`` loaded (at most ``max_steps`` in all)."""
        b, _, text = self._window
        if self.device.type == "cpu":
            self._run_cpu(b, num_steps, text)
            return
        graph = self.graphs.get((b, text))
        for _ in range(num_steps):
            graph.replay() if graph is not None else self._step(b, text)

    @torch.inference_mode()
    def outputs(self, num_steps: int) -> tuple[Tensor, Tensor]:
        """The window's first ``num_steps`` steps' hidden states and tokens (see ``run``)."""
        assert 1 <= num_steps <= self.max_steps
        n = self._window[1]
        # the hidden states' buffer is rewritten by the next window, which may be queued before these are read
        return self.state.out_hidden[:num_steps, :n].clone(), self.state.out_tokens[:num_steps, :n]

    def _load(self, seqs: list[Sequence], b: int, lanes: int) -> None:
        """Copy the batch's state into the static buffers; padding rows write nothing and are ignored."""
        s, q = self.state, self.num_vq
        tokens, positions, limits = [], [], []
        for seq in seqs:
            tokens.append(seq.tokens[-1])
            positions.append(len(seq) - 1)
            limits.append(seq.max_tokens - 1)
        pad = b - len(seqs)
        tokens += [(0,) * q] * pad
        positions += [0] * pad
        limits += [0] * pad
        s.tokens[:b].copy_(torch.tensor(tokens), non_blocking=True)
        s.positions[:b].copy_(torch.tensor(positions), non_blocking=True)
        s.limit[:b].copy_(torch.tensor(limits), non_blocking=True)
        self._load_tables(seqs, b)
        self._load_params(seqs, b, lanes)
        s.step_out.zero_()

    def _load_tables(self, seqs: list[Sequence], b: int) -> None:
        host = self._host_tables[self._next_table]  # free: its last copy ran before the window just read
        self._next_table ^= 1
        table = host.numpy()
        table[:b] = 0
        for i, seq in enumerate(seqs):
            table[i, : len(seq.block_table)] = seq.block_table
        self.state.block_tables[:b].copy_(host[:b], non_blocking=True)

    def _load_params(self, seqs: list[Sequence], b: int, lanes: int) -> None:
        """Sampling rows: ``lanes`` a sequence (the codebooks; 1 in text mode)."""
        p, rows = self.state.params, b * lanes
        host = row_params(seqs, lanes, self.num_vq, MAX_PENALTY_WINDOW)
        for name, value in vars(host).items():
            dst = getattr(p, name)[:rows]
            dst[: value.size(0)].copy_(value, non_blocking=True)
            # padding rows: neutral parameters, an empty history
            dst[value.size(0) :].fill_(-1 if name == "history" else 1 if value.is_floating_point() else 0)
