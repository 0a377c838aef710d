"""The fused sampling kernel (``kernels.sampling``) draws the reference chain's ids: through the Triton
interpreter on small shapes (one subprocess started with ``TRITON_INTERPRET=1``, as in test_kernels.py), on
CUDA at the real model's shape (``-m gpu``), and its draws follow the softmax of the filtered logits.

Rows cycle through every branch of the chain. Penalties are powers of two, so ``penalty ** count`` is exact in
both (the kernel multiplies, torch calls pow); ties at a threshold are practically impossible with random
float logits, so every row must draw the same id.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
from interpreter import report, run_interpreter_main
from torch import Tensor

from chattts_velocity.kernels.sampling import process_rows, sample_rows_fused, sample_rows_fused_ref
from chattts_velocity.kernels.sampling_hash import U_MAX, counter_uniform

EOS = 5
EDGE = (7, 28504, 0, 95)
"""(seed, step, lane, id) whose uniform is clamped to U_MAX: E is tiny, so the id must stay filtered out."""


def make_rows(rows: int, vocab: int, width: int, seed: int) -> dict:
    """``sample_rows_fused``'s arguments (CPU) for ``rows`` rows whose parameters cycle through the chain's
    branches: top-p 0.7 / off / 0.05 (under 3 ids: the minimum of 3 applies), top-k 3 / 20 / off, penalty
    off / 2 / 0.5 over windows of width..0 with some short histories, EOS (made the likeliest id) banned in half
    the rows, varied seeds, steps and lanes."""
    g = torch.Generator().manual_seed(seed)
    i = torch.arange(rows)
    logits = torch.randn(rows, vocab, generator=g)
    logits[:, EOS] = logits.max(1).values + 0.5
    history = torch.randint(0, vocab, (rows, width), generator=g)
    history[:, -2:] = logits.topk(2, dim=1).indices  # the penalty hits the likeliest ids
    history[i % 5 == 1, : width // 2] = -1
    step = torch.randint(0, 4000, (rows,), generator=g)
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    lane = i % 4
    seeds[0], step[0], lane[0] = EDGE[:3]
    if vocab > EDGE[3]:
        logits[0, EDGE[3]] = logits.min() - 1  # row 0 keeps 3 ids (top-k 3): the edge id is filtered out
    return dict(
        logits=logits,
        temperature=torch.tensor([1.0, 0.7, 1.5])[(i // 2) % 3, None],
        top_p=torch.tensor([0.7, 1.0, 0.05])[i % 3, None],
        top_k=torch.tensor([3, 20, 1 << 30])[(i // 3) % 3],
        penalty=torch.tensor([1.0, 2.0, 0.5, 2.0])[i % 4, None],
        history=history,
        window=torch.tensor([width, width // 2, 1, 0])[(i // 4) % 4],
        min_new=torch.where((i // 6) % 2 == 0, step + 1, 0),
        seed=seeds, step=step, lane=lane, eos_id=EOS,
    )


def _to(args: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in args.items()}


def _assert_same_ids(args: dict, ids: list[int], ref: list[int]) -> None:
    banned = (args["step"] < args["min_new"]).tolist()
    assert not any(b and r == EOS for b, r in zip(banned, ref, strict=True)), "reference drew a banned EOS"
    diff = [(r, a, b) for r, (a, b) in enumerate(zip(ids, ref, strict=True)) if a != b]
    assert not diff, f"(row, kernel id, reference id): {diff}"


# ------------------------------------------------------------------------------- the interpreter subprocess

INTERPRETER_ROWS = {40: 48, 626: 12}
"""Rows per vocabulary: the small one is cheap in the interpreter, so more rows catch off-by-one filters."""


def interpreter_main() -> None:
    """Entry point of the subprocess: kernel and reference ids per vocabulary, as one JSON line."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    results = {}
    for vocab, rows in INTERPRETER_ROWS.items():
        args = make_rows(rows, vocab, 8, seed=vocab)
        results[vocab] = {"kernel": sample_rows_fused(**args).tolist(), "ref": sample_rows_fused_ref(**args).tolist()}
    ran = "chattts_velocity.kernels._triton.sampling" in sys.modules
    report({"ids": results, "ran_triton": ran})


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    pytest.importorskip("triton")
    results = run_interpreter_main("test_sampling_kernel")
    assert results["ran_triton"], "the kernel never ran on Triton"
    return results["ids"]


@pytest.mark.parametrize("vocab", INTERPRETER_ROWS)
def test_fused_kernel_draws_the_reference_ids_in_the_interpreter(vocab: int, interpreter_results: dict) -> None:
    ids = interpreter_results[str(vocab)]
    _assert_same_ids(make_rows(INTERPRETER_ROWS[vocab], vocab, 8, seed=vocab), ids["kernel"], ids["ref"])


def test_the_edge_uniform_is_exercised() -> None:
    """Row 0 of ``make_rows`` draws the clamped uniform at a filtered id (so the old NaN would have won)."""
    seed, step, lane, col = (torch.tensor([v]) for v in EDGE)
    assert counter_uniform(seed, step, lane, 626)[0, col] == U_MAX
    args = make_rows(12, 626, 8, seed=626)
    del args["seed"], args["lane"]
    assert process_rows(**args)[0, EDGE[3]] == -float("inf")


@pytest.mark.parametrize(("override", "message"), [
    ({"logits": torch.zeros(12, 40, dtype=torch.float16)}, "logits must have dtype float32"),
    ({"temperature": torch.ones(12)}, "temperature must be [R, 1]"),
    ({"top_p": torch.ones(12, 2)}, "top_p must be [R, 1] with R = 12"),
    ({"top_k": torch.ones(11, dtype=torch.int64)}, "top_k must be [R] with R = 12"),
    ({"history": torch.zeros(8, 12, dtype=torch.int64).T}, "history must be contiguous"),
    ({"seed": torch.zeros(12, dtype=torch.int32)}, "seed must have dtype int64"),
    ({"eos_id": 40}, "eos_id must be an int in [0, 40)"),
])
def test_launcher_rejects_bad_arguments_with_a_clear_message(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        sample_rows_fused(**{**make_rows(12, 40, 8, seed=0), **override})


# ------------------------------------------------------------------------------------------------- on CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_fused_kernel_draws_the_reference_ids_on_gpu() -> None:
    args = make_rows(4 * 256, 626, 64, seed=1)
    ids = sample_rows_fused(**_to(args, "cuda")).tolist()
    _assert_same_ids(args, ids, sample_rows_fused_ref(**args).tolist())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_fused_kernel_draws_follow_the_filtered_softmax() -> None:
    """One row's parameters over n steps: the id counts match softmax(filtered logits) (chi-square within
    five standard deviations of its mean), and no filtered-out id is ever drawn."""
    n, vocab = 1 << 18, 626
    row = make_rows(1, vocab, 64, seed=2)
    row.update(top_p=torch.tensor([[0.9]]), top_k=torch.tensor([40]), penalty=torch.tensor([[1.05]]),
               temperature=torch.tensor([[0.7]]), window=torch.tensor([64]), min_new=torch.tensor([0]))
    probs = torch.softmax(process_rows(**{k: v for k, v in row.items() if k not in ("seed", "lane")}), -1)[0]
    args = {k: v.expand(n, *v.shape[1:]).contiguous() if isinstance(v, Tensor) else v for k, v in row.items()}
    args["step"] = torch.arange(n)
    counts = torch.bincount(sample_rows_fused(**_to(args, "cuda")).cpu(), minlength=vocab).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0, "drew a filtered-out id"
    expected = probs[kept].double() * n
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum().item()
    dof = int(kept.sum()) - 1
    assert 2 <= dof and chi2 < dof + 5 * (2 * dof) ** 0.5, f"chi2 {chi2:.1f} with {dof} degrees of freedom"
