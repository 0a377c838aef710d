"""``Sampler``: ChatTTS's logits chain for a whole batch at once, every row with its own parameters, and seeded
sampling that is batch-invariant.

Rows are (sequence, codebook) pairs in code mode and sequences in text mode. The chain is upstream's order
(temperature -> repetition penalty -> top-p -> top-k -> EOS mask below ``min_new_tokens``), applied row-wise,
so a row's result never depends on its neighbours. Sampling is an exponential race (argmax of p / E with
E = -log U), where U comes from a counter-based hash of (seed, step, codebook, id): the same request gives
the same tokens alone, in any batch, in any order, and after preemption. The chain and the race run as
``kernels.sampling.sample_rows_fused``: one Triton launch per step, its torch reference on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.sampling import sample_rows_fused
from .sequence import Sequence


@dataclass
class RowParams:
    """Per-row sampling parameters as tensors, named as ``sample_rows_fused``'s arguments. R rows."""

    temperature: Tensor  # [R, 1] float32
    top_p: Tensor  # [R, 1] float32 (1 = off)
    top_k: Tensor  # [R] int64 (huge = off)
    penalty: Tensor  # [R, 1] float32 (1 = off)
    history: Tensor  # [R, W] int64 recent generated ids, newest last, -1 = none
    window: Tensor  # [R] int64: how many of the newest history entries the penalty counts
    min_new: Tensor  # [R] int64: EOS is banned while step < min_new
    seed: Tensor  # [R] int64
    step: Tensor  # [R] int64: tokens generated so far
    lane: Tensor  # [R] int64: codebook

    def to(self, device: torch.device) -> RowParams:
        return RowParams(**{k: v.to(device, non_blocking=True) for k, v in vars(self).items()})

    def rows(self, n: int) -> RowParams:
        """The first ``n`` rows (views)."""
        return RowParams(**{k: v[:n] for k, v in vars(self).items()})


def row_params(seqs: list[Sequence], lanes: int, num_vq: int, width: int) -> RowParams:
    """Host tensors of the rows of ``seqs`` (``lanes`` rows each: num_vq in code mode, 1 in text mode).
    Per-sequence values are gathered once and repeated over the lanes with numpy: this runs once per decode
    window for the whole batch, where per-row Python lists cost several times more."""
    n = len(seqs)
    params = [s.params for s in seqs]
    temps = np.array([p.temperatures(num_vq) for p in params], dtype=np.float32).reshape(-1, 1)

    def per_seq(values, dtype):
        return np.repeat(np.array(values, dtype=dtype), lanes)

    hist = np.full((n, lanes, width), -1, dtype=np.int64)
    for i, s in enumerate(seqs):
        start = max(s.prompt_len, len(s) - s.params.penalty_window)
        if start < len(s):
            recent = s.tokens.rows(start)[:, :lanes]  # [w, lanes]
            hist[i, :, width - len(recent) :] = recent.T
    return RowParams(
        temperature=torch.from_numpy(temps),
        top_p=torch.from_numpy(per_seq([1.0 if p.top_p is None else p.top_p for p in params], np.float32))[:, None],
        top_k=torch.from_numpy(per_seq([1 << 30 if p.top_k is None else p.top_k for p in params], np.int64)),
        penalty=torch.from_numpy(per_seq([1.0 if p.repetition_penalty is None else p.repetition_penalty
                                          for p in params], np.float32))[:, None],
        history=torch.from_numpy(hist.reshape(n * lanes, width)),
        window=torch.from_numpy(per_seq([p.penalty_window for p in params], np.int64)),
        min_new=torch.from_numpy(per_seq([p.min_new_tokens for p in params], np.int64)),
        seed=torch.from_numpy(per_seq([s.seed for s in seqs], np.int64)),
        step=torch.from_numpy(per_seq([s.num_generated for s in seqs], np.int64)),
        lane=torch.from_numpy(np.tile(np.arange(lanes, dtype=np.int64), n)),
    )


LOW_SCALE = 2048.0
"""The low half of a split head is stored times this (2 ** 11, float16's mantissa), so that it stays in
float16's normal range; its product is scaled back exactly."""


def split_head(weight: Tensor) -> Tensor:
    """[N, K] float32 -> [2N, K] float16: the weight rounded to float16, then its rounding error times
    ``LOW_SCALE``. hi + lo / LOW_SCALE holds about 22 of float32's 24 mantissa bits."""
    hi = weight.half()
    lo = ((weight - hi.float()) * LOW_SCALE).half()
    return torch.cat([hi, lo])


def split_logits(half: Tensor, split: Tensor) -> Tensor:
    """[M, K] float16 rows times a ``split_head`` [2N, K] -> [M, N] float32: one float16 GEMM with float32
    sums and output (each product of two float16 values is exact in float32), then hi + lo / LOW_SCALE."""
    n = split.size(0) // 2
    y = torch.mm(half, split.T, out_dtype=torch.float32) if half.is_cuda else half.float() @ split.float().T
    return torch.add(y[:, :n], y[:, n:], alpha=1.0 / LOW_SCALE)


def _half_mm_to_float32(device: torch.device) -> bool:
    """Whether this torch multiplies float16 matrices into a float32 result on ``device`` (``torch.mm``'s
    ``out_dtype``, on CUDA)."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones(2, 2, dtype=torch.float16, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def sample_rows(logits: Tensor, p: RowParams, eos_id: int) -> Tensor:
    """[R, V] float32 logits -> [R] sampled ids: the whole chain in one fused launch on Triton."""
    return sample_rows_fused(logits, **vars(p), eos_id=eos_id)


class Sampler:
    """Samples the next token of every sequence that reached its last position, code and text mode mixed."""

    def __init__(self, embed, num_vq: int, code_eos: int, text_eos: int, half_core: bool = False):
        self.embed = embed
        self.num_vq = num_vq
        self.code_eos = code_eos
        self.text_eos = text_eos
        with torch.inference_mode():
            self.code_head = embed.code_head_matrix()  # [Q * V, H] float32: one GEMM for the 4 heads
            self.text_head = embed.text_head_matrix()  # [V_text, H] float32: no weight norm per step
            self.code_head_split = split_head(self.code_head) if half_core and _half_mm_to_float32(
                self.code_head.device) else None
            """``split_head`` of the code head where the core computes in float16 on CUDA (``code_logits``'s
            ``half``), else None."""

    def code_logits(self, hidden: Tensor, core_out: Tensor | None = None) -> Tensor:
        """[S, H] float32 -> [S*Q, V] audio logits, rows ordered (sequence, codebook). ``core_out``: the core's
        output of which ``hidden`` is the float32 copy: where the code head is split (``split_head``: only for a
        float16 core), the product runs from it on float16 tensor cores with float32 sums (the weight kept to
        about 22 of float32's 24 mantissa bits)."""
        if core_out is not None and self.code_head_split is not None:
            return split_logits(core_out, self.code_head_split).view(hidden.size(0) * self.num_vq, -1)
        return (hidden @ self.code_head.T).view(hidden.size(0) * self.num_vq, -1)

    def text_logits(self, hidden: Tensor) -> Tensor:
        """[S, H] float32 -> [S, V_text] text logits (``Embed.text_logits``' values, bit for bit)."""
        return F.linear(hidden, self.text_head)

    @torch.inference_mode()
    def __call__(self, hidden: Tensor, seqs: list[Sequence]) -> Tensor:
        """hidden [S, H] float32, one row per sequence -> [S, Q] int64 tokens on its device (a text token
        repeats its id over the codebooks), not waited for."""
        modes = {s.text_mode for s in seqs}
        if len(modes) == 1:
            return self._sample_group(hidden, seqs, modes.pop())
        tokens = hidden.new_empty((len(seqs), self.num_vq), dtype=torch.int64)  # none, or both modes
        for text_mode in modes:
            idx = [i for i, s in enumerate(seqs) if s.text_mode == text_mode]
            rows = torch.tensor(idx, device=hidden.device)
            tokens[rows] = self._sample_group(hidden[rows], [seqs[i] for i in idx], text_mode)
        return tokens

    def _sample_group(self, hidden: Tensor, seqs: list[Sequence], text_mode: bool) -> Tensor:
        if text_mode:
            ids = sample_rows(self.text_logits(hidden), self._params(seqs, 1, hidden.device), self.text_eos)
            return ids[:, None].expand(len(seqs), self.num_vq)
        ids = sample_rows(self.code_logits(hidden), self._params(seqs, self.num_vq, hidden.device), self.code_eos)
        return ids.view(len(seqs), self.num_vq)

    def _params(self, seqs: list[Sequence], lanes: int, device: torch.device) -> RowParams:
        width = max(s.params.penalty_window for s in seqs)
        return row_params(seqs, lanes, self.num_vq, width).to(device)
