"""The velocity engine on an NVIDIA GPU (Triton kernels, CUDA graphs), against the CPU reference path.
Run on the device machine: ``python -m pytest -m gpu tests/test_gpu_engine.py``."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import record_windows

from chattts_velocity.engine import EngineConfig, LLMEngine, Mode, Prompt, SamplingParams
from chattts_velocity.engine.scheduler import ScheduledSeq

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def model():
    """Full-size random weights (the real shapes), built on the CPU then moved per test."""
    from chattts_velocity.model.loader import ModelLoader

    return ModelLoader(torch.device("cuda"), "dummy").load(None)


def teacher_forcing_inputs(model, length=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 20000, (40,), generator=g)
    codes = torch.randint(0, 625, (length - 40, 4), generator=g)
    ids = torch.cat([text[:, None].expand(-1, 4), codes])  # [T, 4]
    mask = torch.cat([torch.ones(40, dtype=torch.bool), torch.zeros(length - 40, dtype=torch.bool)])
    return ids, mask


@torch.inference_mode()
def engine_logits(model, dtype: str, ids, mask) -> torch.Tensor:
    """Code logits [T, V, 4] of every position of one prefill through the engine's core (paged KV)."""
    engine = LLMEngine.from_model(model, EngineConfig(dtype=dtype, num_kv_blocks=64, max_num_seqs=4,
                                                      max_num_batched_tokens=4096, num_decode_steps=1), "cuda")
    seq = engine.make_sequence("tf", Prompt(ids, mask), SamplingParams())
    engine.block_manager.allocate(seq, len(seq))
    hidden, _ = engine.runner.forward([ScheduledSeq(seq, len(seq))])
    engine.block_manager.free(seq)
    return model.gpt.embed.code_logits(hidden.float())


def reference_logits(model, ids, mask, device: str = "cpu") -> torch.Tensor:
    """The transformers LlamaModel path in fp32 (the reference decode's model), on ``device``."""
    gpt = model.gpt.to(device)
    try:
        code, _ = gpt.teacher_forced_logits(ids[None].to(device), mask[None].to(device),
                                            torch.ones(1, ids.size(0), dtype=torch.int64, device=device))
    finally:
        model.gpt.to("cuda")
    return code[0].cpu()


def test_fp32_teacher_forced_logits_equal_the_cpu_reference(model):
    ids, mask = teacher_forcing_inputs(model)
    ref = reference_logits(model, ids, mask)
    ours = engine_logits(model, "float32", ids.cuda(), mask.cuda()).cpu()
    diff = (ours - ref).abs().max().item()
    # The reference model itself moved to the GPU differs from its CPU run (cuBLAS vs CPU GEMM rounding over
    # 20 layers); the engine must be within 1e-4, or no further from the CPU than that.
    gpu_ref_diff = (reference_logits(model, ids, mask, "cuda") - ref).abs().max().item()
    print(f"fp32 max |logit diff| vs CPU: engine {diff:.3g}, reference on GPU {gpu_ref_diff:.3g}, "
          f"max |logit| {ref.abs().max().item():.3g}")
    assert diff <= max(1e-4, 1.5 * gpu_ref_diff), f"fp32 logits differ by {diff:.3g}"


@pytest.mark.parametrize("dtype", [
    "float16",
    pytest.param("bfloat16", marks=pytest.mark.xfail(
        strict=True, reason="bf16's 8-bit mantissa flips near-ties of random weights' flat logits, below the "
                            "top-1 agreement float16 reaches")),
])
def test_half_precision_top1_agrees_with_fp32(model, dtype):
    ids, mask = teacher_forcing_inputs(model, seed=1)
    ref = reference_logits(model, ids, mask)
    ours = engine_logits(model, dtype, ids.cuda(), mask.cuda()).cpu()
    agree = (ours.argmax(1) == ref.argmax(1)).float().mean().item()
    print(f"{dtype}: top-1 agreement {agree:.4f}")
    assert agree >= 0.99, f"{dtype} top-1 agreement {agree:.4f} < 0.99"


def run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params[i])
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_graphs_and_eager_give_identical_tokens(model, dtype):
    """Audio and refine (text) requests, with the decode windows' and the padded prefills' CUDA graphs and
    without: the same tokens. Every window stop applies and every window runs whole
    (``window_stop_budget_ms=None``, ``window_budget_ms=None``): with the budgets the windows' ends follow the
    measured step time, which eager steps multiply, and where a sequence that finished inside a window leaves
    the batch at another step the others' float16 GEMMs round differently."""
    prompts = []
    for i in range(6):
        ids, mask = teacher_forcing_inputs(model, length=60 + 17 * i, seed=10 + i)
        prompts.append(Prompt(ids, mask))
    params = [SamplingParams(seed=i, min_new_tokens=20 + 9 * i, max_new_tokens=40 + 13 * i) for i in range(6)]
    for i in range(3):  # refine requests: text prompts, text tokens
        ids = torch.randint(0, 20000, (30 + 11 * i, 1), generator=torch.Generator().manual_seed(40 + i))
        prompts.append(Prompt(ids.expand(-1, 4), torch.ones(ids.size(0), dtype=torch.bool)))
        params.append(SamplingParams(mode=Mode.TEXT, temperature=(0.7,), seed=i, repetition_penalty=1.0,
                                     min_new_tokens=20, max_new_tokens=30 + 9 * i))
    outs = {}
    for eager in (False, True):
        engine = LLMEngine.from_model(model, EngineConfig(dtype=dtype, max_num_seqs=8, kv_cache_gib=1,
                                                          enforce_eager=eager, window_stop_budget_ms=None,
                                                          window_budget_ms=None), "cuda")
        runner = engine.runner
        assert (runner.decoder.graphs == {}) == eager == (runner.prefill.graphs == {})
        modes = []
        record_windows(engine, lambda window, continuing, modes=modes: modes.append(window.seqs[0].text_mode))
        outs[eager] = run(engine, prompts, params)
        assert True in modes and False in modes, "both audio and text windows must have run"
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for a, b in zip(outs[False], outs[True], strict=True):
        assert torch.equal(a.token_ids, b.token_ids), "CUDA-graph and eager tokens differ"
        assert a.num_generated >= 20


def test_gpu_engine_equals_reference_under_argmax(model):
    """Decoding on the GPU (fp32) gives the reference path's codes under argmax sampling."""
    from chattts_velocity.reference import DecodeSettings, reference_generate

    ids, mask = teacher_forcing_inputs(model, length=80, seed=3)
    p = SamplingParams(temperature=(1e-4,), seed=0, min_new_tokens=30, max_new_tokens=30)
    engine = LLMEngine.from_model(model, EngineConfig(dtype="float32", max_num_seqs=4, kv_cache_gib=1), "cuda")
    (out,) = run(engine, [Prompt(ids, mask)], [p])
    settings = DecodeSettings(text_mode=False, temperature=(1e-4,) * 4, top_p=0.7, top_k=20, repetition_penalty=1.05,
                              max_new_token=30, min_new_token=30, eos_id=model.config.eos_code,
                              penalty_row_cap=None, manual_seed=0, show_tqdm=False)
    ref = list(reference_generate(model.gpt, ids[None].cuda(), torch.ones(1, 80, dtype=torch.int64, device="cuda"),
                                  mask[None].cuda(), settings))[-1]
    assert torch.equal(out.token_ids, ref.ids[0].cpu())


def test_an_arrival_ends_an_open_window_on_cuda(model):
    """On CUDA (graph replays queued a few steps ahead of the device, one event a step): requests handed over
    through ``arrivals`` during full windows end them early and run their prompt step next; under argmax in
    fp32 every request's tokens equal those of whole windows, where the same requests join later."""
    prompts = [Prompt(*teacher_forcing_inputs(model, length=60 + 20 * i, seed=20 + i)) for i in range(3)]
    params = [SamplingParams(temperature=(1e-4,), seed=i, min_new_tokens=90, max_new_tokens=90) for i in range(3)]

    def generate(lookahead):
        engine = LLMEngine.from_model(model, EngineConfig(dtype="float32", max_num_seqs=4, kv_cache_gib=1,
                                                          open_window_max_seqs=16 if lookahead else 0,
                                                          pipeline_decode=True), "cuda")
        steps, calls = [], []
        collect = engine.runner.collect
        engine.runner.collect = lambda w: (steps.append((w.decode, w.num_steps)), collect(w))[1]

        at = (20, 60) if lookahead else (1, 2)  # whole windows ask only between two of them

        def arrivals() -> bool:  # r1 and r2 arrive at these calls
            calls.append(None)
            if len(calls) in at:
                i = 1 + at.index(len(calls))
                engine.add_request(f"r{i}", prompts[i], params[i])
                return True
            return False

        engine.arrivals = arrivals
        engine.add_request("r0", prompts[0], params[0])
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return [done[f"r{i}"] for i in range(3)], steps

    cut, steps = generate(4)
    whole, whole_steps = generate(None)
    full = EngineConfig().num_decode_steps
    before_prompts = [steps[i - 1] for i in range(1, len(steps)) if steps[i] == (False, 1)]
    assert len(before_prompts) == 2 and all(d and 4 <= k < full for d, k in before_prompts), steps
    assert all(k == full for _, k in (whole_steps[i - 1] for i in range(1, len(whole_steps))
                                      if whole_steps[i] == (False, 1))), whole_steps
    for a, b in zip(cut, whole, strict=True):
        assert a.num_generated == b.num_generated == 90
        assert torch.equal(a.token_ids, b.token_ids), "an open window changed the tokens"
