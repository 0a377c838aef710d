"""ChatTTS input embeddings and output heads (``asset/Embed.safetensors``).

State-dict keys equal upstream's: ``emb_code.{q}.weight``, ``emb_text.weight`` and the weight-norm parametrised
heads ``head_text`` / ``head_code.{q}`` (``parametrizations.weight.original0`` = g, ``original1`` = v).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from .stacked import stacked_weights


class Embed(nn.Module):
    def __init__(self, hidden_size: int, num_audio_tokens: int, num_text_tokens: int, num_vq: int = 4):
        super().__init__()
        self.num_vq = num_vq
        self.emb_code = nn.ModuleList(nn.Embedding(num_audio_tokens, hidden_size) for _ in range(num_vq))
        self.emb_text = nn.Embedding(num_text_tokens, hidden_size)
        self.head_text = weight_norm(nn.Linear(hidden_size, num_text_tokens, bias=False), name="weight")
        self.head_code = nn.ModuleList(
            weight_norm(nn.Linear(hidden_size, num_audio_tokens, bias=False), name="weight") for _ in range(num_vq)
        )

    def forward(self, input_ids: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        """Prompt embeddings: text positions use ``emb_text`` of codebook 0, audio positions sum the 4 codes.

        input_ids [B, T, num_vq], text_mask [B, T] bool -> [B, T, H]
        """
        emb_text = self.emb_text(input_ids[text_mask][:, 0])  # [Nt, H]
        codes = input_ids[~text_mask]  # [Na, num_vq]
        # stack+sum (not a running sum): the same reduction order as upstream, so the bits match.
        emb_code = torch.stack([self.emb_code[q](codes[:, q]) for q in range(self.num_vq)], 2).sum(2)  # [Na, H]
        emb = torch.zeros(input_ids.shape[:-1] + (emb_text.shape[-1],), dtype=emb_text.dtype, device=emb_text.device)
        emb[text_mask] = emb_text
        emb[~text_mask] = emb_code.to(emb.dtype)
        return emb

    def embed_step(self, ids: torch.Tensor, text_mode: bool) -> torch.Tensor:
        """Embeddings of freshly sampled tokens. ids [B, T, num_vq] -> [B, T, H]."""
        if text_mode:
            return self.emb_text(ids[:, :, 0])
        return torch.stack([self.emb_code[q](ids[:, :, q]) for q in range(self.num_vq)], 3).sum(3)

    def fuse_code_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The code embeddings as one [num_vq * V, H] table, which the per-codebook weights become views of (so
        they are held once), and each codebook's row offset in it [num_vq], for ``embed_codes``."""
        table = stacked_weights(list(self.emb_code))
        offsets = torch.arange(self.num_vq, device=table.device) * self.emb_code[0].num_embeddings
        return table, offsets

    def embed_rows(self, ids: torch.Tensor, text_rows: torch.Tensor, code_rows: torch.Tensor,
                   table: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``forward``'s embeddings (the same bits) of flat ids [N, num_vq] whose text and audio rows are given
        as index tensors, so nothing waits for the device to find them (a boolean mask does); audio rows through
        ``fuse_code_tables``' table. -> [N, H]"""
        weight = self.emb_text.weight
        emb = torch.empty(ids.size(0), weight.size(1), dtype=weight.dtype, device=weight.device)
        if text_rows.numel():
            emb[text_rows] = self.emb_text(ids[text_rows, 0])
        if code_rows.numel():
            emb[code_rows] = self.embed_codes(ids[code_rows], table, offsets).to(emb.dtype)
        return emb

    @staticmethod
    def embed_codes(ids: torch.Tensor, table: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """ids [B, num_vq] audio codes -> [B, H]: ``embed_step``'s sums (the same bits: both add the codebooks in
        order) in one lookup of ``fuse_code_tables``'s table (the CPU decode step's)."""
        return F.embedding(ids + offsets, table).sum(1)

    def code_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., num_audio_tokens, num_vq] (float32)."""
        with parametrize.cached():
            return torch.stack([head(hidden).float() for head in self.head_code], -1)

    def code_head_matrix(self) -> torch.Tensor:
        """The 4 weight-normed code heads as one [num_vq * V, H] matrix (materialised once, for the engine's
        decode: one GEMM per step instead of 4 GEMVs and 4 weight-norm recomputations)."""
        with parametrize.cached():
            return torch.cat([head.weight for head in self.head_code]).detach().clone()

    def text_head_matrix(self) -> torch.Tensor:
        """The weight-normed text head [V_text, H], materialised once for the engine's refine steps: normalising
        the full-size weight was most of a CPU refine step (docs/perf/)."""
        with parametrize.cached():
            return self.head_text.weight.detach().clone()

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., num_text_tokens] (float32)."""
        with parametrize.cached():
            return self.head_text(hidden).float()
