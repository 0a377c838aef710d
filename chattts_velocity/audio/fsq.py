"""Grouped residual finite scalar quantization (FSQ): the codebook of ChatTTS's DVAE.

Same maths as ``vector_quantize_pytorch``'s ``GroupedResidualFSQ`` as upstream configures it (ResidualFSQ with
``preserve_symmetry=True`` and ``bound_hard_clamp=True``), with the float ops in the same order so that codes
and features match it bit for bit. The feature dim is split into G groups; each group is projected to one
value per level dimension and quantized R times, each step on the residual of the last at a finer scale.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class ResidualFSQ(nn.Module):
    """One group: features [..., dim] <-> R residual code indices [..., R] in ``[0, prod(levels))``."""

    def __init__(self, dim: int, levels: tuple[int, ...], residuals: int):
        super().__init__()
        self.project_in = nn.Linear(dim, len(levels))
        self.project_out = nn.Linear(len(levels), dim)
        self.codebook_size = math.prod(levels)
        # None of these are in the checkpoint (upstream keeps them non-persistent): all derive from `levels`.
        lv = torch.tensor(levels)  # [n]
        self.register_buffer("levels", lv, persistent=False)
        self.register_buffer("levels_minus_1", (lv - 1).float(), persistent=False)
        # index = sum_i level_index_i * basis_i (mixed radix, first dimension least significant)
        self.register_buffer("basis", torch.cumprod(torch.tensor([1, *levels[:-1]]), 0), persistent=False)
        self.register_buffer("step", 2.0 / (lv - 1), persistent=False)  # spacing of the grid on [-1, 1]
        # inputs are soft-clamped to [-c, c] with c half a step past 1, so that the hard clamp rarely bites
        self.register_buffer("clamp_value", 1 + 1 / (lv - 1), persistent=False)
        # residual step r quantizes on a grid levels**r times finer
        scales = torch.stack([lv.float() ** -r for r in range(residuals)])  # [R, n]
        self.register_buffer("scales", scales, persistent=False)

    def encode(self, x: Tensor) -> Tensor:
        """Features [B, T, dim] float -> indices [B, T, R] int32."""
        z = self.project_in(x).float()  # [B, T, n]
        residual = (z / self.clamp_value).tanh() * self.clamp_value
        indices = []
        for scale in self.scales:  # [n]
            bounded = (residual / scale).clamp(-1.0, 1.0)
            level = torch.floor(self.levels_minus_1 * (bounded + 1) / 2.0 + 0.5)  # [B, T, n] in 0..L-1
            indices.append((level.long() * self.basis).sum(-1))  # [B, T]
            residual = residual - (self.step * level - 1.0) * scale
        return torch.stack(indices, dim=-1).int()  # [B, T, R]

    def decode(self, indices: Tensor) -> Tensor:
        """Indices [B, T, R] int -> features [B, T, dim]: sum of the R scaled codes, projected out."""
        per_step = indices.movedim(-1, 0).unsqueeze(-1).long()  # [R, B, T, 1]
        level = (per_step // self.basis) % self.levels  # [R, B, T, n]
        codes = (level * self.step - 1.0) * self.scales[:, None, None, :]  # [R, B, T, n]
        return self.project_out(codes.sum(0).to(self.project_out.weight.dtype))  # [B, T, dim]


class GroupedResidualFSQ(nn.Module):
    """G independent :class:`ResidualFSQ` over consecutive slices of the feature dim."""

    def __init__(self, dim: int, levels: tuple[int, ...], groups: int, residuals: int):
        super().__init__()
        self.rvqs = nn.ModuleList(ResidualFSQ(dim // groups, levels, residuals) for _ in range(groups))

    def encode(self, x: Tensor) -> Tensor:
        """Features [B, T, dim] -> indices [G, B, T, R]."""
        chunks = x.chunk(len(self.rvqs), dim=-1)  # G x [B, T, dim/G]
        return torch.stack([rvq.encode(chunk) for rvq, chunk in zip(self.rvqs, chunks, strict=True)])

    def decode(self, indices: Tensor) -> Tensor:
        """Indices [G, B, T, R] -> features [B, T, dim]."""
        return torch.cat([rvq.decode(ind) for rvq, ind in zip(self.rvqs, indices, strict=True)], dim=-1)


class GFSQ(nn.Module):
    """Channel-first codes [B, G*R, T] <-> features [B, dim, T]; the ``vq_layer`` of upstream's DVAE.

    Code channel ``g*R + r`` is residual step r of group g, the order ChatTTS's GPT emits its 4 codes in.
    """

    def __init__(self, dim: int, levels: tuple[int, ...], groups: int, residuals: int):
        super().__init__()
        self.groups = groups
        self.residuals = residuals
        self.codebook_size = math.prod(levels)
        self.quantizer = GroupedResidualFSQ(dim, levels, groups, residuals)

    def encode(self, x: Tensor) -> Tensor:
        """Features [B, dim, T] -> codes [B, G*R, T] int32."""
        indices = self.quantizer.encode(x.transpose(1, 2))  # [G, B, T, R]
        return indices.permute(1, 2, 0, 3).flatten(2).transpose(1, 2)  # [B, G*R, T]

    def decode(self, codes: Tensor) -> Tensor:
        """Codes [B, G*R, T] int -> features [B, dim, T]."""
        grouped = codes.transpose(1, 2).unflatten(2, (self.groups, self.residuals))  # [B, T, G, R]
        return self.quantizer.decode(grouped.permute(2, 0, 1, 3)).transpose(1, 2)  # [B, dim, T]
