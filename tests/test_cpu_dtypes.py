"""The CPU engine dtypes (float16, bfloat16, int8 matrices; float32 activations and KV cache): each weight is
stored in its format and multiplied as its torch reference says; every matrix of the engine (the layers and the
code and text heads) is stored so; the float32 engine and the reference path are what they were; and each
dtype's top-1 codes follow the float32 engine's under teacher forcing on the tiny checkpoint (the full-size
figures: ``chattts-velocity bench agreement --size full``, docs/perf/cpu.md)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from chattts_velocity import device as device_module
from chattts_velocity.bench.agreement import agreement, sampled_codes, teacher_forced
from chattts_velocity.cpu_threads import on_own_thread
from chattts_velocity.engine import EngineConfig, LLMEngine, Mode, Prompt, SamplingParams
from chattts_velocity.engine.engine_config import CPU_WEIGHTS, ENGINE_DTYPES
from chattts_velocity.engine.model_runner import CpuHeadSampler
from chattts_velocity.engine.sampler import Sampler
from chattts_velocity.kernels.linear import (
    CPU_WEIGHT_FORMATS,
    CpuWeight,
    cpu_weight_formats,
    cpu_weight_linear_ref,
)
from chattts_velocity.model.llama import LlamaCore
from chattts_velocity.text import decorate_code_prompts, decorate_text_prompts

CPU_DTYPES = list(CPU_WEIGHTS)
STORED = {"float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}
# the largest error of a stored weight, relative to its row's largest magnitude
WEIGHT_STEP = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "int8": 0.5 / 127 + 2.0**-9}
# the least share of equal top-1 codes under teacher forcing on the tiny checkpoint, 100 steps; the measured
# shares sit above these with a margin (docs/perf/cpu.md)
AGREEMENT = {"float16": 0.995, "bfloat16": 0.97, "int8": 0.95}
STEPS = 100


@pytest.mark.parametrize("fmt", CPU_WEIGHT_FORMATS)
@pytest.mark.parametrize("shape", [(37, 32), (130, 64), (8, 224)], ids=str)
def test_a_cpu_weight_is_stored_in_its_format_and_multiplies_as_its_reference(fmt, shape):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=gen) * 0.05
    weight = CpuWeight(w, fmt)
    assert weight.shape == w.shape and weight.size(0) == shape[0] and weight.stored_dtype == STORED[fmt]
    scales = 0 if fmt != "int8" else 2 * shape[0]  # one bfloat16 scale a row
    assert weight.nbytes == w.numel() * STORED[fmt].itemsize + scales
    err = (weight.dequantized() - w).abs().amax(1) / w.abs().amax(1)
    assert err.max() <= WEIGHT_STEP[fmt], f"{fmt}: a stored weight is off by {err.max():.3g} of its row's largest"
    for rows in (1, 3, 8):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, shape[1], generator=gen).to(dtype)
            got, want = weight(x), cpu_weight_linear_ref(x, weight)
            assert got.dtype == dtype and got.shape == (rows, shape[0])
            # bfloat16 results: one rounding step apart at most (the kernels' float32 sums run in their order)
            tol = 1e-5 if fmt == "float16" and dtype == torch.float32 else 2.0**-7
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())


def test_int8_rows_use_the_whole_range_and_bad_formats_are_refused():
    w = torch.randn(50, 32, generator=torch.Generator().manual_seed(1))
    w[7] = 0  # an all-zero row keeps a positive scale
    weight = CpuWeight(w, "int8")
    assert weight.data.dtype == torch.int8 and weight.scale.dtype == torch.bfloat16
    rows = torch.arange(50) != 7
    assert (weight.data[rows].abs().amax(1) == 127).all() and (weight.data[7] == 0).all() and weight.scale[7] > 0
    with pytest.raises(ValueError, match="fmt must be one of float16, bfloat16, int8"):
        CpuWeight(w, "float8")
    with pytest.raises(ValueError, match="weight must be"):
        CpuWeight(w[0], "int8")
    with pytest.raises(ValueError, match="int8 CPU weights need a multiple of 32 inputs"):
        CpuWeight(w[:, :24], "int8")  # torch's kernel would return garbage
    for fmt in ("float16", "bfloat16"):  # any width
        odd = CpuWeight(w[:, :24], fmt)
        x = torch.randn(3, 24)
        torch.testing.assert_close(odd(x), cpu_weight_linear_ref(x, odd), rtol=2.0**-7, atol=1e-2)


def _stacked_llama(layer) -> dict[str, torch.Tensor]:
    att, mlp = layer.self_attn, layer.mlp
    return {"qkv": torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]), "o": att.o_proj.weight,
            "gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), "down": mlp.down_proj.weight}


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_every_matrix_of_a_cpu_dtype_engine_is_stored_in_its_format(chat, dtype):
    """The four matrices of every layer and the code and text heads: the format, the shapes, the values; the
    norms, KV cache and activations stay float32, and the core shares nothing with the float32 weights."""
    engine = LLMEngine.from_model(chat.model, EngineConfig(dtype=dtype, num_kv_blocks=8), "cpu")
    runner, fmt = engine.runner, CPU_WEIGHTS[dtype]
    core = runner.core
    assert core.dtype == torch.float32 and core.weights == fmt and not core.shares_weights(chat.model.gpt.llama)
    assert all(k.dtype == torch.float32 and v.dtype == torch.float32 for k, v in runner.kv_caches)
    for layer, hf in zip(core.layers, chat.model.gpt.llama.layers, strict=True):
        assert layer.input_norm.dtype == torch.float32 and layer.post_norm.dtype == torch.float32
        for name, want in _stacked_llama(hf).items():
            got = getattr(layer, name)
            assert isinstance(got, CpuWeight) and got.fmt == fmt and got.stored_dtype == STORED[fmt], name
            assert got.shape == want.shape, name
            err = (got.dequantized() - want).abs().amax(1) / want.abs().amax(1)
            assert err.max() <= WEIGHT_STEP[fmt], name
    sampler, embed = runner.sampler, chat.model.gpt.embed
    assert isinstance(sampler, CpuHeadSampler)
    for head, want in ((sampler.code_head, embed.code_head_matrix()), (sampler.text_head, embed.text_head_matrix())):
        assert isinstance(head, CpuWeight) and head.fmt == fmt and head.shape == want.shape
    hidden = torch.randn(3, chat.model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    logits = sampler.code_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (3 * 4, chat.model.config.num_audio_tokens)
    assert torch.equal(sampler.text_logits(hidden), sampler.text_head(hidden))


def test_the_float32_engine_keeps_the_transformers_weights_and_plain_heads(chat):
    """float32 is what it was: the core's matrices are views of the transformers Llama's weights and the heads
    the weight-normed float32 matrices, multiplied by the plain ``Sampler``."""
    engine = LLMEngine.from_model(chat.model, EngineConfig(dtype="float32", num_kv_blocks=8), "cpu")
    runner, llama = engine.runner, chat.model.gpt.llama
    assert runner.core.weights is None and runner.core.shares_weights(llama)
    for layer, hf in zip(runner.core.layers, llama.layers, strict=True):
        for name, want in _stacked_llama(hf).items():
            got = getattr(layer, name)
            assert type(got) is torch.Tensor and got.dtype == torch.float32 and torch.equal(got, want), name
    assert type(runner.sampler) is Sampler
    assert torch.equal(runner.sampler.code_head, chat.model.gpt.embed.code_head_matrix())


def test_int8_runs_on_the_cpu_only_and_every_dtype_is_an_engine_dtype():
    assert set(CPU_WEIGHTS) <= set(ENGINE_DTYPES) and "int8" in ENGINE_DTYPES
    config = EngineConfig(dtype="int8")
    assert config.core_format(torch.device("cpu")) == (torch.float32, "int8")
    with pytest.raises(ValueError, match="runs on the CPU only"):
        config.core_format(torch.device("cuda"))
    assert EngineConfig(dtype="float16").core_format(torch.device("cuda")) == (torch.float16, None)
    with pytest.raises(ValueError, match="a CPU weight format"):
        LlamaCore(None, torch.float32, torch.device("cuda"), "int8")


def test_the_cpu_default_is_float16_where_its_kernel_runs(monkeypatch):
    assert cpu_weight_formats() == CPU_WEIGHT_FORMATS  # an x86 CPU: fbgemm, oneDNN and the int8 kernel run
    assert device_module.default_engine_dtype("cpu") == "float16"
    monkeypatch.setattr(device_module, "cpu_weight_formats", lambda: ("bfloat16", "int8"))
    assert device_module.default_engine_dtype("cpu") == "float32"


@pytest.fixture(scope="module")
def forced(chat):
    """The float32 engine's sampled codes at batch 1 and 8, and its own teacher-forced run over them."""
    model, prompt = chat.model, _prompt(chat, "hello there")
    out = {}
    for batch in (1, 8):
        codes = sampled_codes(model, prompt, batch, STEPS)
        out[batch] = prompt, codes, teacher_forced(model, "float32", prompt, codes)
    return out


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_top1_codes_follow_the_float32_engine_under_teacher_forcing(chat, forced, dtype, batch):
    prompt, codes, reference = forced[batch]
    assert codes.shape == (batch, STEPS, 4) and reference.top1.shape == (STEPS, batch, 4)
    assert agreement(reference, teacher_forced(chat.model, "float32", prompt, codes)) == 1.0
    share = agreement(reference, teacher_forced(chat.model, dtype, prompt, codes))
    assert share >= AGREEMENT[dtype], f"{dtype} at batch {batch}: {share:.4f} of top-1 codes agree"


def _generate(chat, dtype: str, prompts: list[Prompt], seeds: list[int], text: bool = False,
              **config) -> list[torch.Tensor]:
    engine = LLMEngine.from_model(chat.model, EngineConfig(dtype=dtype, max_num_seqs=8, **config), "cpu")
    for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
        params = SamplingParams(min_new_tokens=20, max_new_tokens=40, seed=seed)
        if text:  # a refine pass: the text head
            params = SamplingParams(mode=Mode.TEXT, temperature=(0.7,), max_new_tokens=30, seed=seed,
                                    return_hidden_states=False)
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out.token_ids) for out in engine.step() if out.finished)
    return [done[str(i)] for i in range(len(prompts))]


def _prompt(chat, text: str) -> Prompt:
    (decorated,) = decorate_code_prompts([text], "[speed_5]", None, False)
    ids, _, text_mask = chat.model.tokenizer.encode([decorated], 4)
    return Prompt(ids[0], text_mask[0])


def _prompts(chat, n: int) -> list[Prompt]:
    return [_prompt(chat, f"sentence number {i}" + " more" * i) for i in range(n)]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_decode_windows_give_the_tokens_of_single_steps(chat, dtype):
    """A window's steps and one-step scheduling multiply through the same kernels: the same tokens, in audio
    and in refine (text head) batches."""
    prompts = _prompts(chat, 3)
    windows = _generate(chat, dtype, prompts, [1, 2, 3])
    steps = _generate(chat, dtype, prompts, [1, 2, 3], num_decode_steps=1)
    assert all(torch.equal(a, b) for a, b in zip(windows, steps, strict=True))
    (decorated,) = decorate_text_prompts(["refine this sentence please"], "")
    ids, _, text_mask = chat.model.tokenizer.encode([decorated], 4)
    refine = [Prompt(ids[0], text_mask[0])] * 2
    windows = _generate(chat, dtype, refine, [4, 5], text=True)
    steps = _generate(chat, dtype, refine, [4, 5], text=True, num_decode_steps=1)
    assert windows[0].numel() > 0 and all(torch.equal(a, b) for a, b in zip(windows, steps, strict=True))


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_float16_and_int8_requests_get_the_same_tokens_in_any_batch(chat, dtype):
    """Their kernels compute each row alone (bfloat16's oneDNN GEMM does not: EngineConfig.dtype says so)."""
    prompts = _prompts(chat, 6)
    alone = _generate(chat, dtype, prompts[:1], [7])[0]
    crowded = _generate(chat, dtype, prompts[1:] + prompts[:1], [1, 2, 3, 4, 5, 7])[-1]
    assert torch.equal(alone, crowded)


@pytest.mark.parametrize("dtype", ["int8", "float16"])
def test_the_reference_path_stays_upstream_s_float32_beside_a_cpu_dtype_engine(chat, upstream_ckpt, dtype):
    """The engine lets the float32 Llama go; the reference path reads it again and gives the float32 load's
    audio bit for bit."""
    from chattts_velocity import Chat

    other = Chat()
    other.load(source="custom", custom_path=upstream_ckpt, device="cpu", num_kv_blocks=32, engine_dtype=dtype)
    try:
        assert other.model.gpt.llama_released

        def reference(c):
            params = c.InferCodeParams(manual_seed=3, max_new_token=16)
            return c.infer(["hello"], params_infer_code=params, skip_refine_text=True, use_velocity=False)[0]

        np.testing.assert_array_equal(reference(other), reference(chat))
        assert other.infer(["hello"], skip_refine_text=True)[0].size > 0
    finally:
        other.unload()


def test_cpu_work_runs_on_a_thread_of_its_own_and_answers_as_if_called_here() -> None:
    """``cpu_threads.on_own_thread``: on the CPU ``fn`` runs on another thread (whose OpenMP team ends with it), with
    the caller's grad and inference modes, its result returned and its error raised here; elsewhere it runs
    here."""
    def where(x):
        return threading.get_ident(), torch.is_grad_enabled(), torch.is_inference_mode_enabled(), x * 2

    here = threading.get_ident()
    ident, grad, inference, value = on_own_thread(torch.device("cpu"), where, 21)
    assert ident != here and (grad, inference, value) == (True, False, 42)
    with torch.inference_mode():
        _, grad, inference, _ = on_own_thread(torch.device("cpu"), where, 1)
    assert (grad, inference) == (False, True)
    with torch.no_grad():
        assert on_own_thread(torch.device("cpu"), where, 1)[1] is False
    assert on_own_thread(torch.device("meta"), where, 1)[0] == here  # not the CPU: called directly

    def fails():
        raise KeyError("from the worker")

    with pytest.raises(KeyError, match="from the worker"):
        on_own_thread(torch.device("cpu"), fails)
