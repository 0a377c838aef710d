"""``PaddedPrefill``: on CUDA a prefill step (any step that is not one token per sequence) of up to
``PREFILL_SEQS[-1]`` sequences and ``PREFILL_TOKENS[-1]`` tokens runs padded to the next bucket of both: the
padding tokens belong to no sequence and write no KV, the padding sequences are empty. Each bucket's core
forward is a CUDA graph, so a lone prompt's prefill does not pay the host's launch of every kernel, which costs
many times the device's work (docs/perf/). Eager runs (``enforce_eager``) pad
the same way, so both compute the same shapes and give the same bits.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ..model.llama import AttentionMetadata, LlamaCore

logger = logging.getLogger(__name__)

PREFILL_TOKENS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
PREFILL_SEQS = (1, 4, 16, 64, 256)
"""The buckets. A burst of requests (a server's clients starting together, a batch of ``chat.infer``) prefills
in steps of up to 256 prompts: each step's host cost (its inputs, its launch, its report, an audio round) comes
once a step, and in steps of 64 it came four times for 256 prompts (docs/perf/)."""


class PaddedPrefill:
    """The padded prefill steps: static input buffers sized for the largest bucket, and each bucket's CUDA graph
    once ``capture`` ran (eager on the same buffers before)."""

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
