"""``ModelRunner``: turns a scheduled step into flat tensors, builds ChatTTS input embeddings (text ids, summed
codes, speaker vector), runs the Llama core over the paged KV cache and samples the sequences that reached
their last position, capturing the hidden state that produced each sampled token."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..model.llama import AttentionMetadata, LlamaCore
from .sampler import Sampler
from .scheduler import ScheduledSeq
from .sequence import Sequence, Token


@dataclass
class StepResult:
    seqs: list[Sequence]
    """The sequences that sampled a token this step."""
    tokens: list[Token]
    hidden: Tensor
    """[len(seqs), H] float32: the final-norm hidden state behind each token."""


class ModelRunner:
    def __init__(self, gpt, core: LlamaCore, kv_caches: list[tuple[Tensor, Tensor]], block_size: int,
                 spk_emb_id: int, sampler: Sampler, device: torch.device):
        self.gpt = gpt
        self.core = core
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.spk_emb_id = spk_emb_id
        self.sampler = sampler
        self.device = device

    @torch.inference_mode()
    def forward(self, scheduled: list[ScheduledSeq]) -> tuple[Tensor, Tensor]:
        """Run the scheduled tokens through the core (writing their K/V): hidden states [N, H] (core dtype) and
        the rows [S] of each sampling sequence's last token."""
        ids, is_text, meta, last_rows = self._prepare(scheduled)
        emb = self._embed(ids, is_text, scheduled)  # [N, H]
        return self.core.forward(emb, meta, self.kv_caches), last_rows

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> StepResult:
        hidden, last_rows = self.forward(scheduled)
        sampling = [s.seq for s in scheduled if s.samples]
        hidden = hidden[last_rows].float()  # [S, H]
        tokens = self.sampler(hidden, sampling) if sampling else []
        return StepResult(sampling, tokens, hidden)

    def _prepare(self, scheduled: list[ScheduledSeq]):
        bs = self.block_size
        ids, is_text, positions, slots, cu, ctx, last_rows = [], [], [], [], [0], [], []
        for item in scheduled:
            seq, start = item.seq, item.start
            end = start + item.num_new_tokens
            ids += seq.tokens[start:end]
            is_text += seq.is_text[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            cu.append(cu[-1] + item.num_new_tokens)
            ctx.append(end)
            if item.samples:
                last_rows.append(cu[-1] - 1)
        width = max(len(s.seq.block_table) for s in scheduled)
        tables = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in scheduled]
        dev = self.device

        def i32(v):
            return torch.tensor(v, dtype=torch.int32, device=dev)

        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            cu_seqlens_q=i32(cu), context_lens=i32(ctx), block_tables=i32(tables),
            decode_only=cu[-1] == len(scheduled),
        )
        ids_t = torch.tensor(ids, dtype=torch.int64, device=dev)  # [N, num_vq]
        return ids_t, torch.tensor(is_text, device=dev), meta, torch.tensor(last_rows, dtype=torch.int64, device=dev)

    def _embed(self, ids: Tensor, is_text: Tensor, scheduled: list[ScheduledSeq]) -> Tensor:
        """[N, num_vq] ids -> [N, H] embeddings, ChatTTS-style, the speaker vector at ``[spk_emb]`` positions."""
        emb = self.gpt.embed(ids[None], is_text[None])[0]  # [N, H]
        offset = 0
        for item in scheduled:
            n, seq = item.num_new_tokens, item.seq
            if seq.speaker is not None:
                chunk = slice(offset, offset + n)
                at = is_text[chunk] & ids[chunk, 0].eq(self.spk_emb_id)
                emb[chunk][at] = seq.speaker.to(device=emb.device, dtype=emb.dtype)
            offset += n
        return emb
