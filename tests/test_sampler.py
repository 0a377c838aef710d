"""The engine's batched sampler: each row's chain equals upstream's processors with that row's params, the
fused top-p/top-k equals the two filters in turn, the exponential race samples the right distribution, and the
Triton race (interpreter) draws the same ids as the torch reference."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from chattts_velocity.engine.sampler import RowParams
from chattts_velocity.kernels.sampling import exponential_race_ref, process_rows
from chattts_velocity.kernels.sampling_hash import U_MAX, counter_uniform
from chattts_velocity.sampling.processors import process_logits

EOS = 9
ROWS = [  # temperature, top_p, top_k, penalty, min_new, step
    (0.3, 0.7, 20, 1.05, 0, 5),
    (1.0, None, None, None, 3, 1),
    (0.7, 0.95, 3, 1.3, 0, 0),
    (0.1, 0.5, None, 1.0, 10, 20),
    (2.0, None, 7, 1.5, 2, 2),
]


def make_params(history: torch.Tensor) -> RowParams:
    n = len(ROWS)

    def col(i, off):
        return [off if r[i] is None else r[i] for r in ROWS]

    return RowParams(
        temperature=torch.tensor(col(0, 1.0))[:, None], top_p=torch.tensor(col(1, 1.0))[:, None],
        top_k=torch.tensor(col(2, 1 << 30)), penalty=torch.tensor(col(3, 1.0))[:, None], history=history,
        window=torch.full((n,), 16), min_new=torch.tensor(col(4, 0)), seed=torch.arange(n),
        step=torch.tensor(col(5, 0)), lane=torch.zeros(n, dtype=torch.int64),
    )


def _process(logits: torch.Tensor, p: RowParams, eos_id: int) -> torch.Tensor:
    return process_rows(logits, p.temperature, p.top_p, p.top_k, p.penalty, p.history, p.window, p.min_new, p.step,
                        eos_id)


def test_each_row_equals_upstreams_chain_with_its_own_params():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(ROWS), 40, generator=g) * 3
    history = torch.randint(0, 40, (len(ROWS), 16), generator=g)
    history[1, :10] = -1  # a short history
    ours = _process(logits.clone(), make_params(history), EOS)
    for i, (t, top_p, top_k, pen, min_new, step) in enumerate(ROWS):
        hist = history[i : i + 1][history[i : i + 1] >= 0][None]
        ref = process_logits(logits[i : i + 1].clone(), hist, torch.tensor([[t]]), top_p, top_k, pen,
                             step < min_new, EOS)
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref[0])), f"row {i}: different ids kept"
        kept = ~torch.isinf(ref[0])
        assert torch.allclose(ours[i][kept], ref[0][kept], atol=1e-6), f"row {i}: logits differ"


def test_penalty_window_counts_only_the_newest_ids():
    logits = torch.ones(1, 8)
    history = torch.tensor([[3, 3, 3, 5]])
    p = RowParams(torch.ones(1, 1), torch.ones(1, 1), torch.tensor([1 << 30]), torch.full((1, 1), 2.0), history,
                  torch.tensor([1]), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                  torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    out = _process(logits, p, eos_id=7)
    assert out[0, 5] == 0.5 and out[0, 3] == 1.0  # only the newest id (5) is inside a window of 1


def test_exponential_race_samples_the_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]])
    n = 20000
    ids = exponential_race_ref(probs.expand(n, -1).contiguous(), torch.full((n,), 7), torch.arange(n),
                               torch.zeros(n, dtype=torch.int64))
    freq = torch.bincount(ids, minlength=5).float() / n
    assert freq[4] == 0, "a zero-probability id must never win"
    assert torch.allclose(freq, probs[0], atol=0.015), f"frequencies {freq.tolist()}"


def test_counter_uniforms_are_a_pure_function_of_their_counters():
    seed, step, lane = torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), torch.tensor([0, 0, 0])
    u = counter_uniform(seed, step, lane, 626)
    again = counter_uniform(seed[[2, 0]], step[[2, 0]], lane[[2, 0]], 626)
    assert torch.equal(u[[2, 0]], again), "a row's numbers must not depend on the other rows"
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01


def test_counter_uniforms_stay_below_one():
    """(seed 7, step 28504, lane 0, id 95) hits the top bucket, which rounds to 1.0 in float32: clamped, so
    E = -log U stays positive and a zero-probability id can never win the race with p / E = 0 / 0 = NaN."""
    one = (torch.tensor([7]), torch.tensor([28504]), torch.tensor([0]))
    assert counter_uniform(*one, 626)[0, 95] == U_MAX
    probs = torch.zeros(1, 626)
    probs[0, :3] = torch.tensor([0.5, 0.3, 0.2])
    assert exponential_race_ref(probs, *one).item() < 3


_INTERPRETER_CHECK = """
import torch
from chattts_velocity.kernels.sampling import exponential_race_ref
from chattts_velocity.kernels._triton.sampling import exponential_race_triton
torch.manual_seed(0)
for vocab in (626, 100, 1500):
    probs = torch.softmax(torch.randn(6, vocab) * 3, -1)
    probs[0, 5:] = 0
    seed = torch.randint(0, 2**62, (6,)); seed[1] = 2**63 - 1
    step, lane = torch.randint(0, 4000, (6,)), torch.arange(6) % 4
    seed[2], step[2], lane[2] = 7, 28504, 0  # U clamped to U_MAX at id 95
    a = exponential_race_ref(probs, seed, step, lane).tolist()
    b = exponential_race_triton(probs, seed, step, lane).tolist()
    assert a == b, (vocab, a, b)
print("RACE OK")
"""


def test_triton_race_draws_the_reference_ids_in_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_CHECK], env=env, capture_output=True, text=True,
                          timeout=600)
    assert "RACE OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_race_draws_the_reference_ids_on_gpu():
    from chattts_velocity.kernels.sampling import exponential_race

    probs = torch.softmax(torch.randn(1024, 626) * 3, -1)
    seed, step, lane = torch.randint(0, 2**62, (1024,)), torch.randint(0, 4000, (1024,)), torch.arange(1024) % 4
    ref = exponential_race_ref(probs, seed, step, lane)
    gpu = exponential_race(probs.cuda(), seed.cuda(), step.cuda(), lane.cuda()).cpu()
    assert (ref == gpu).float().mean().item() >= 0.999  # log/divide may differ by an ulp on a near-tie


def test_a_split_code_head_gives_the_float32_logits_of_float16_rows():
    """The code head as float16 hi + scaled lo rows: a float16 core's output times it, summed in float32 (here
    emulated in float32 on the CPU, as the float16 tensor cores with float32 sums compute it), equals the float32
    product to float32's own rounding, for heads of the weight norm's magnitudes (small rows included, whose
    low halves would be float16 subnormals unscaled); float16 rounding of the head alone is hundreds of times
    further off."""
    from chattts_velocity.engine.sampler import split_head, split_logits

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(2504, 768, generator=gen) * torch.logspace(-4, 0, 2504)[:, None]
    half = (torch.randn(64, 768, generator=gen) * 3).half()
    split = split_head(weight)
    assert split.dtype == torch.float16 and split.shape == (5008, 768)
    exact = half.double() @ weight.double().T
    scale = half.double().abs() @ weight.double().abs().T
    got = split_logits(half, split)
    assert got.dtype == torch.float32 and got.shape == (64, 2504)
    assert ((got.double() - exact).abs() / scale).max() < 2e-7
    float32 = half.float() @ weight.T
    assert ((float32.double() - exact).abs() / scale).max() < 2e-7
    rounded = half.float() @ weight.half().float().T
    assert ((rounded.double() - exact).abs() / scale).max() > 2e-5


def test_the_code_head_is_split_only_for_a_float16_core_on_cuda():
    from chattts_velocity.engine.sampler import Sampler

    class Embed:
        def code_head_matrix(self):
            return torch.randn(8, 4)

        def text_head_matrix(self):
            return torch.randn(5, 4)

    assert Sampler(Embed(), 2, 0, 0, half_core=True).code_head_split is None  # (on the CPU)
    hidden = torch.randn(3, 4)
    sampler = Sampler(Embed(), 2, 0, 0)
    torch.testing.assert_close(sampler.code_logits(hidden, hidden.half()), (hidden @ sampler.code_head.T).view(6, 4))


def test_number_checks_take_python_and_numpy_numbers_and_refuse_bools_and_others():
    from fractions import Fraction

    from chattts_velocity.sampling.limits import is_int, is_num, plain

    for x in (0, -3, 2**70, np.int64(5), np.uint8(7)):
        assert is_int(x) and is_num(x), x
    for x in (0.5, float("nan"), np.float32(0.5), np.float64(2), Fraction(1, 3)):
        assert not is_int(x) and is_num(x), x
    for x in (True, False, np.bool_(True), None, "3", [1], 1j):
        assert not is_int(x) and not is_num(x), x
    assert type(plain(np.int64(5))) is int and type(plain(np.float32(0.5))) is float
    assert plain([np.int64(1), 2.5]) == [1, 2.5] and plain(None) is None and plain(True) is True
    kept = 3
    assert plain(kept) is kept
