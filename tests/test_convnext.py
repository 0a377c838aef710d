"""The fused channels-last ConvNeXt kernels of the wav decode (``kernels.convnext``, ``audio.convnext``) against
upstream's torch ops: kernel by kernel and whole stacks (the Decoder's conv stack, Vocos's backbone) through
the Triton interpreter on tiny shapes (one subprocess started with ``TRITON_INTERPRET=1``, as in
test_kernels.py), at the real sizes on CUDA (``-m gpu``), and which path a decode takes."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from interpreter import fix_interpreter_for_numpy_2_4, report, run_interpreter_main
from vocos.models import VocosBackbone

from chattts_velocity.audio import convnext
from chattts_velocity.audio.convnext import conv_stack, fused_applies, operand_weight, vocos_backbone
from chattts_velocity.audio.dvae import ConvStack, ConvStackConfig
from chattts_velocity.kernels.convnext import dwconv_norm, dwconv_norm_ref, linear, linear_ref
from chattts_velocity.model.checkpoint import randomize_


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter drawn again (``randomize_``: the layer scales too, which start as constants)."""
    randomize_(module, torch.Generator().manual_seed(seed))
    return module.eval()


def _stack(hidden: int, n_layer: int, idim: int = 8, seed: int = 0) -> ConvStack:
    return _randomize(ConvStack(ConvStackConfig(idim=idim, odim=idim, hidden=hidden, n_layer=n_layer,
                                                bn_dim=idim)), seed)


def _backbone(dim: int, n_layer: int, n_mels: int = 12, seed: int = 1) -> VocosBackbone:
    return _randomize(VocosBackbone(input_channels=n_mels, dim=dim, intermediate_dim=3 * dim,
                                    num_layers=n_layer), seed)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _dwconv_args(b: int, t: int, c: int, k: int, dilation: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, c, generator=g) * 2 + 0.5
    return (x, torch.randn(c, 1, k, generator=g) * 0.3, torch.randn(c, generator=g) * 0.1, dilation,
            dilation * (k // 2), 1 + 0.2 * torch.randn(c, generator=g), 0.1 * torch.randn(c, generator=g), 1e-6)


def _linear_args(m: int, k: int, n: int, seed: int, residual: bool) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(seed)
    x, w, bias = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5, torch.randn(n, generator=g)
    extra = dict(scale=1 + 0.3 * torch.randn(n, generator=g), residual=torch.randn(m, n, generator=g)) if residual \
        else dict(gelu=True)
    return (x, w, bias), extra


# ------------------------------------------------------------------------------------ interpreter subprocess

def _interpreter_cases() -> dict[str, float]:
    """Each case's largest error relative to the output's largest magnitude."""
    out = {}
    for name, (b, t, c, k, dil) in {"dwconv_dilated": (2, 19, 24, 7, 2), "dwconv_vocos": (1, 5, 40, 7, 1),
                                    "dwconv_long": (2, 37, 24, 3, 1)}.items():
        args = _dwconv_args(b, t, c, k, dil, seed=len(name))
        out[name] = _rel(dwconv_norm(*args), dwconv_norm_ref(*args))
        out[name + "_fp16_out"] = _rel(dwconv_norm(*args, out_dtype=torch.float16),
                                       dwconv_norm_ref(*args, out_dtype=torch.float16))
    args = _dwconv_args(3, 19, 24, 7, 2, seed=9)
    lengths = torch.tensor([19, 7, 1], dtype=torch.int32)
    for suffix, dtype in (("", torch.float32), ("_fp16_out", torch.float16)):
        got = dwconv_norm(*args, out_dtype=dtype, lengths=lengths)
        alone = [dwconv_norm_ref(args[0][b:b + 1, :n].contiguous(), *args[1:], out_dtype=dtype)[0]
                 for b, n in enumerate(lengths.tolist())]
        out["dwconv_lengths" + suffix] = _rel(torch.cat([got[b, :n] for b, n in enumerate(lengths.tolist())]),
                                              torch.cat(alone))
    for name, (m, k, n, res) in {"linear_gelu": (37, 48, 80, False), "linear_residual": (37, 80, 48, True),
                                 "linear_one_row": (1, 24, 72, False), "linear_ragged_k": (130, 40, 20, True)}.items():
        args, extra = _linear_args(m, k, n, seed=m + k, residual=res)
        out[name] = _rel(linear(*args, **extra, tf32=False), linear_ref(*args, **extra))
        small = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2)
        out[name + "_small_tiles"] = _rel(linear(*args, **extra, tf32=False, tile=small), linear_ref(*args, **extra))
    args, extra = _linear_args(33, 32, 64, seed=3, residual=False)
    half = (args[0].half(), args[1].half(), args[2])
    out["linear_fp16_operands"] = _rel(linear(*half, **extra, out_dtype=torch.float16),
                                       linear_ref(*half, **extra, out_dtype=torch.float16))
    out["linear_tf32_runs"] = _rel(linear(*args, **extra, tf32=True), linear_ref(*args, **extra))
    big = (half[0] * 300, half[1] * 300, half[2])  # outputs up to ~1e6: past float16's range, saturated
    ref = linear_ref(*big, gelu=True).clamp(-65504, 65504)
    assert float(ref.abs().max()) == 65504
    out["linear_saturates_fp16_out"] = _rel(linear(*big, gelu=True, out_dtype=torch.float16), ref)
    with torch.inference_mode():
        stack = _stack(hidden=24, n_layer=2)
        x = torch.randn(2, 8, 23, generator=torch.Generator().manual_seed(5))
        backbone = _backbone(dim=32, n_layer=2)
        mel = torch.randn(2, 12, 17, generator=torch.Generator().manual_seed(6))
        for suffix, dtype in (("", torch.float32), ("_fp16_operands", torch.float16)):
            out["decoder_conv_stack" + suffix] = _rel(conv_stack(stack, stack.conv_in(x), dtype), stack(x))
            out["vocos_backbone" + suffix] = _rel(vocos_backbone(backbone, mel, True, dtype), backbone(mel))
    out.update(_forced_decode_cases())
    return out


def _forced_decode_cases() -> dict[str, float]:
    """``AudioDecoder.to_wavs`` of the tiny checkpoint, hidden states and codes, with the fused stacks forced
    on (as on CUDA with TF32) against the modules' ops: the decode paths reach the fused kernels."""
    from chattts_velocity.audio import AudioDecoder, convnext, dvae
    from chattts_velocity.bench.runner import load_model

    model = load_model("tiny", torch.device("cpu"), 0)
    audio = AudioDecoder(model.dvae, model.decoder, model.vocos, "cpu", mixed_lengths=True)
    g = torch.Generator().manual_seed(7)
    width = 2 * audio.decoder.config.decoder.idim
    hiddens = [torch.randn(n, width, generator=g) for n in (9, 9)]
    codes = [torch.randint(0, 625, (9, 4), generator=g) for _ in range(2)]
    wants = {name: audio.to_wavs(x, name == "hiddens") for name, x in (("hiddens", hiddens), ("codes", codes))}
    varied = {"hiddens": [torch.randn(n, width, generator=g) for n in (9, 4, 6)],
              "codes": [torch.randint(0, 625, (n, 4), generator=g) for n in (3, 9, 5)]}
    alone = {name: np.concatenate([audio.to_wavs([r], name == "hiddens")[0] for r in rows])
             for name, rows in varied.items()}
    out = {}
    saved = convnext.fused_applies, dvae.fused_applies
    called = []

    def forced(x):
        called.append(x.shape)
        return True

    convnext.fused_applies = dvae.fused_applies = forced
    try:
        for suffix, dtype in (("", torch.float32), ("_fp16_operands", torch.float16)):
            convnext.OPERANDS = dtype
            for name, x in (("hiddens", hiddens), ("codes", codes)):
                got = audio.to_wavs(x, name == "hiddens")
                out[f"to_wavs_{name}{suffix}"] = _rel(torch.from_numpy(got), torch.from_numpy(wants[name]))
                # rows of their own lengths in one batch: the kernels read each row's padding as zeros
                got = np.concatenate(audio.to_wav_list(varied[name], name == "hiddens"))
                out[f"to_wav_list_{name}{suffix}"] = _rel(torch.from_numpy(got), torch.from_numpy(alone[name]))
    finally:
        convnext.fused_applies, dvae.fused_applies = saved
        convnext.OPERANDS = torch.float16
    assert len(called) == 16, called  # the DVAE's or the Decoder's stack, and Vocos's backbone, every call
    return out


def interpreter_main() -> None:
    """Entry point of the subprocess: every case's error, and whether the Triton module ran."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    fix_interpreter_for_numpy_2_4()
    torch.manual_seed(0)
    errors = _interpreter_cases()
    report({"errors": errors, "ran_triton": "chattts_velocity.kernels._triton.convnext" in sys.modules})


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    pytest.importorskip("triton")
    return run_interpreter_main("test_convnext")


TOLERANCE = {"_fp16_out": 2e-3, "_fp16_operands": 2e-3, "_tf32_runs": 2e-3, "hiddens": 1e-4, "codes": 1e-4}
"""Relative error allowed per case suffix (the first that matches); float32 cases 2e-5 (the interpreter
multiplies in float32), wavs 1e-4 (the iSTFT's sums)."""


def test_interpreter_kernels_and_stacks_match_the_torch_ops(interpreter_results: dict) -> None:
    assert interpreter_results["ran_triton"], "the Triton module never ran: the cases compared torch with torch"
    errors = interpreter_results["errors"]
    assert len(errors) == 31, sorted(errors)
    for name, err in errors.items():
        tol = next((t for suffix, t in TOLERANCE.items() if name.endswith(suffix)), 2e-5)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


# ----------------------------------------------------------------------------------------------- on the CPU

def test_references_are_upstreams_block() -> None:
    """dwconv_norm_ref + linear_ref in the fused order = upstream's ConvNeXt block (torch ops on the CPU)."""
    stack = _stack(hidden=16, n_layer=1)
    block = stack.decoder_block[0]
    x = torch.randn(2, 16, 11)
    with torch.no_grad():
        expected = block(x).transpose(1, 2)
        xl = x.transpose(1, 2).contiguous()
        y = dwconv_norm_ref(xl, block.dwconv.weight, block.dwconv.bias, 2, 6, block.norm.weight, block.norm.bias,
                            1e-6)
        h = linear_ref(y.view(-1, 16), block.pwconv1.weight, block.pwconv1.bias, gelu=True)
        got = linear_ref(h, block.pwconv2.weight, block.pwconv2.bias, scale=block.weight,
                         residual=xl.view(-1, 16)).view(2, 11, 16)
    assert _rel(got, expected) < 1e-6


def test_operand_weights_are_copied_once_and_follow_in_place_changes() -> None:
    linear_module = torch.nn.Linear(4, 6)
    first = operand_weight(linear_module.weight, torch.float16)
    assert first.dtype == torch.float16 and torch.equal(first, linear_module.weight.detach().half())
    assert operand_weight(linear_module.weight, torch.float16) is first
    with torch.no_grad():
        linear_module.weight.mul_(2)  # as load_state_dict copies into a parameter
    again = operand_weight(linear_module.weight, torch.float16)
    assert again is first and torch.equal(again, linear_module.weight.detach().half())  # same memory, new values
    assert operand_weight(linear_module.weight, torch.float32) is linear_module.weight
    linear_module.weight.data = torch.randn(6, 4)  # new memory, as module.to may give a parameter
    moved = operand_weight(linear_module.weight, torch.float16)
    assert moved is not first and torch.equal(moved, linear_module.weight.detach().half())
    with torch.inference_mode():
        frozen = torch.nn.Linear(4, 6)
    assert torch.equal(operand_weight(frozen.weight, torch.float16), frozen.weight.half())


def test_the_cpu_and_strict_float32_keep_upstreams_ops(monkeypatch) -> None:
    x = torch.zeros(1, 4, 3)
    monkeypatch.setenv("CHATTTS_VELOCITY_FUSED_DECODE", "1")
    with torch.inference_mode():
        assert not fused_applies(x)  # the CPU, even when asked for
    if torch.cuda.is_available():
        m = torch.backends.cuda.matmul
        saved = m.fp32_precision
        try:
            m.fp32_precision = "ieee"
            with torch.inference_mode():
                assert not fused_applies(x.cuda())
            m.fp32_precision = "tf32"
            with torch.inference_mode():
                assert fused_applies(x.cuda())
            assert not fused_applies(x.cuda())  # autograd on: the modules' ops
        finally:
            m.fp32_precision = saved


@pytest.mark.parametrize("setting, expected", [(None, True), ("1", True), ("", True), ("0", False)])
def test_the_fused_decode_is_on_unless_turned_off(monkeypatch, setting: str | None, expected: bool) -> None:
    if setting is None:
        monkeypatch.delenv("CHATTTS_VELOCITY_FUSED_DECODE", raising=False)
    else:
        monkeypatch.setenv("CHATTTS_VELOCITY_FUSED_DECODE", setting)
    assert convnext.fused_default() is expected


@pytest.mark.parametrize("bad, message", [
    (dict(padding=3), "same' padding"),
    (dict(x=torch.zeros(2, 5, 8).transpose(1, 2)), "contiguous"),
    (dict(x=torch.zeros(2, 8, 5, dtype=torch.float16)), "dtype float32"),
    (dict(conv_weight=torch.zeros(6, 1, 7)), "conv_weight must be [8, 1, K]"),
    (dict(norm_bias=torch.zeros(7)), "norm_bias has 7 elements"),
])
def test_dwconv_norm_rejects_bad_arguments(bad: dict, message: str) -> None:
    args = dict(x=torch.zeros(2, 5, 8), conv_weight=torch.zeros(8, 1, 7), conv_bias=torch.zeros(8), dilation=2,
                padding=6, norm_weight=torch.ones(8), norm_bias=torch.zeros(8), eps=1e-6)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        dwconv_norm(**{**args, **bad})


@pytest.mark.parametrize("bad, message", [
    (dict(scale=torch.ones(6)), "scale and residual come together"),
    (dict(gelu=True, scale=torch.ones(6), residual=torch.zeros(3, 6)), "not both"),
    (dict(weight=torch.zeros(6, 5)), "weight is"),
    (dict(weight=torch.zeros(6, 4, dtype=torch.float16)), "weight must have dtype float32"),
    (dict(bias=torch.zeros(5)), "bias has 5 elements"),
    (dict(bias=torch.zeros(12)[::2]), "bias must be contiguous"),
    (dict(scale=torch.ones(12)[::2], residual=torch.zeros(3, 6)), "scale must be contiguous"),
    (dict(scale=torch.ones(6), residual=torch.zeros(2, 6)), "residual must be"),
])
def test_linear_rejects_bad_arguments(bad: dict, message: str) -> None:
    args = dict(x=torch.zeros(3, 4), weight=torch.zeros(6, 4), bias=torch.zeros(6))
    with pytest.raises(ValueError, match=message):
        linear(**{**args, **bad})


# ---------------------------------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_fused_stacks_match_the_modules_at_the_real_sizes(monkeypatch) -> None:
    """The Decoder's stack (hidden 512, 12 blocks, dilation 2) and Vocos's backbone (512, 1536, 8 blocks) on
    the fused kernels against the modules, both in TF32 (the wav decode's setting) and against strict float32."""
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = m.fp32_precision, c.fp32_precision
    stack = _stack(hidden=512, n_layer=12, idim=384).cuda()
    backbone = _backbone(dim=512, n_layer=8, n_mels=100).cuda()
    for module in (stack, backbone):  # upstream-like magnitudes: layer scales small, as trained ones are
        for name, p in module.named_parameters():
            if name.endswith((".weight", ".gamma")) and p.dim() == 1 and "norm" not in name:
                p.data.mul_(0.1)
    x = torch.randn(4, 384, 300, device="cuda")
    mel = torch.randn(4, 100, 301, device="cuda")
    try:
        m.fp32_precision = c.fp32_precision = "ieee"
        with torch.inference_mode():
            exact = stack(x), backbone(mel)
        m.fp32_precision = c.fp32_precision = "tf32"
        with torch.inference_mode():
            monkeypatch.setenv("CHATTTS_VELOCITY_FUSED_DECODE", "1")  # (off by default beside early launches)
            assert fused_applies(x)
            fused = stack(x), vocos_backbone(backbone, mel)
            monkeypatch.setenv("CHATTTS_VELOCITY_FUSED_DECODE", "0")
            unfused = stack(x), vocos_backbone(backbone, mel)
    finally:
        m.fp32_precision, c.fp32_precision = saved
    for f, u, e, name in zip(fused, unfused, exact, ("decoder", "backbone"), strict=True):
        assert f.shape == e.shape, name
        err_fused, err_torch = _rel(f, e), _rel(u, e)
        # TF32 either way: the fused path's error against strict float32 is of the torch TF32 path's order
        assert err_fused < max(4 * err_torch, 1e-3), f"{name}: fused {err_fused:.2e}, torch TF32 {err_torch:.2e}"
        snr = 10 * np.log10(float((e.double() ** 2).sum() / ((f.double() - e.double()) ** 2).sum()))
        assert snr > 50, f"{name}: SNR {snr:.1f} dB against strict float32"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_rows_of_their_own_lengths_decode_as_each_alone(monkeypatch) -> None:
    """The real-size Decoder stack and Vocos backbone on the fused kernels in TF32, a batch of rows of different
    lengths (``lengths``): each row's frames equal the row decoded alone."""
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = m.fp32_precision, c.fp32_precision
    stack = _stack(hidden=512, n_layer=12, idim=384).cuda()
    backbone = _backbone(dim=512, n_layer=8, n_mels=100).cuda()
    lengths = [300, 41, 170, 2]
    x = torch.randn(len(lengths), 384, 300, device="cuda")
    mel = torch.randn(len(lengths), 100, 300, device="cuda")
    own = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    monkeypatch.setenv("CHATTTS_VELOCITY_FUSED_DECODE", "1")
    try:
        m.fp32_precision = c.fp32_precision = "tf32"
        with torch.inference_mode():
            assert fused_applies(x)
            batched = stack(x, own), vocos_backbone(backbone, mel, lengths=own).transpose(1, 2)
            alone = [(stack(x[b:b + 1, :, :n]), vocos_backbone(backbone, mel[b:b + 1, :, :n]).transpose(1, 2))
                     for b, n in enumerate(lengths)]
    finally:
        m.fp32_precision, c.fp32_precision = saved
    for part, name in enumerate(("decoder", "backbone")):
        for b, n in enumerate(lengths):
            err = _rel(batched[part][b, :, :n], alone[b][part][0])
            assert err < 1e-3, f"{name}, row {b} of {n} frames: relative error {err:.2e}"
