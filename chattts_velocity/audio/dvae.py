"""ChatTTS's DVAE (audio codes <-> mel) and Decoder (GPT hidden states -> mel), loadable from upstream's
``DVAE.safetensors`` / ``Decoder.safetensors`` with every size read off the tensors.

Parameter and buffer names equal upstream's state-dict keys, so upstream files load with ``strict=True``.
Sizes that no tensor records are fixed to upstream's values: FSQ levels per dimension (5), residual steps (2),
ConvNeXt dilation (2), the mel hop (256) and sample rate (24 kHz).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torchaudio
from torch import Tensor, nn

from ..constants import HOP_LENGTH, SAMPLE_RATE
from ..weights import check_state_dict, count_layers, read_safetensors, require
from .convnext import conv_stack, fused_applies, mask_frames
from .fsq import GFSQ

CODE_LEVEL = 5
"""Levels per FSQ dimension: not stored (upstream keeps them in non-persistent buffers); ChatTTS's 626 audio
tokens are 5**4 codes + 1, i.e. 4 dimensions of 5 levels."""


@dataclass(frozen=True)
class ConvStackConfig:
    """Sizes of one upstream ``DVAEDecoder`` conv stack (used as both encoder and decoder)."""

    idim: int
    odim: int
    hidden: int
    n_layer: int
    bn_dim: int
    kernel: int = 7
    dilation: int = 2  # not inferable: only the conv padding depends on it

    @classmethod
    def from_state_dict(cls, sd: dict[str, Tensor], prefix: str, name: str) -> ConvStackConfig:
        bn_dim, idim, _ = require(sd, f"{prefix}.conv_in.0.weight", 3, name).shape
        hidden = require(sd, f"{prefix}.conv_in.2.weight", 3, name).shape[0]
        odim = require(sd, f"{prefix}.conv_out.weight", 3, name).shape[0]
        n_layer = count_layers(sd, f"{prefix}.decoder_block", name)
        kernel = require(sd, f"{prefix}.decoder_block.0.dwconv.weight", 3, name).shape[2] if n_layer else 7
        return cls(idim=idim, odim=odim, hidden=hidden, n_layer=n_layer, bn_dim=bn_dim, kernel=kernel)


@dataclass(frozen=True)
class DVAEConfig:
    """DVAE: codes (``vq_dim`` set), optionally an encoder. Decoder: neither, it reads GPT hidden states."""

    decoder: ConvStackConfig
    dim: int  # width of the decoder output / out_conv input (and of the encoder input)
    encoder: ConvStackConfig | None = None
    vq_dim: int | None = None
    levels: tuple[int, ...] = (CODE_LEVEL,) * 4
    groups: int = 2
    residuals: int = 2  # not inferable: residual FSQ steps hold no weights
    n_mels: int = 100
    n_fft: int = 1024  # of the encoder's mel spectrogram

    def __post_init__(self) -> None:
        problem = next(self._problems(), None)
        if problem is not None:
            raise ValueError(f"inconsistent DVAE sizes: {problem}")

    def _problems(self) -> Iterator[str]:
        enc, dec, vq_dim = self.encoder, self.decoder, self.vq_dim
        if dec.odim != self.dim:
            yield f"decoder.odim {dec.odim} != dim {self.dim}"
        if enc is not None and enc.idim != self.dim:
            yield f"encoder.idim {enc.idim} != dim {self.dim}"
        if vq_dim is not None and vq_dim != 2 * dec.idim:  # the decoder reads half a code frame per mel frame
            yield f"vq_dim {vq_dim} != 2 * decoder.idim {dec.idim}"
        if vq_dim is not None and vq_dim % self.groups:
            yield f"vq_dim {vq_dim} is not divisible by groups {self.groups}"
        if enc is not None and vq_dim is not None and enc.odim != vq_dim:
            yield f"encoder.odim {enc.odim} != vq_dim {vq_dim}"
        if any(level < 2 for level in self.levels):
            yield f"every FSQ level must be >= 2, got {self.levels}"

    @classmethod
    def from_state_dict(cls, sd: dict[str, Tensor], name: str) -> DVAEConfig:
        """Infer every size from tensor shapes, then check each tensor of ``sd`` against them."""
        has_encoder = any(key.startswith("encoder.") for key in sd)
        vq: dict[str, object] = {}
        if any(key.startswith("vq_layer.") for key in sd):
            groups = count_layers(sd, "vq_layer.quantizer.rvqs", name)
            n_dims, group_dim = require(sd, "vq_layer.quantizer.rvqs.0.project_in.weight", 2, name).shape
            vq = dict(vq_dim=groups * group_dim, groups=groups, levels=(CODE_LEVEL,) * n_dims)
        window = "preprocessor_mel.mel_spec.spectrogram.window"
        sizes = dict(
            decoder=ConvStackConfig.from_state_dict(sd, "decoder", name),
            dim=require(sd, "out_conv.weight", 3, name).shape[1],
            encoder=ConvStackConfig.from_state_dict(sd, "encoder", name) if has_encoder else None,
            n_mels=require(sd, "coef", 3, name).shape[1],
            n_fft=require(sd, window, 1, name).shape[0] if has_encoder else 1024,
            **vq,
        )
        try:
            config = cls(**sizes)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        with torch.device("meta"):  # shapes only: allocates nothing
            check_state_dict(DVAE(config), sd, name)
        return config


class ConvNeXtBlock(nn.Module):
    """Residual block: depthwise dilated conv, LayerNorm, 4x MLP, per-channel layer scale (``weight``)."""

    def __init__(self, dim: int, kernel: int, dilation: int):
        super().__init__()
        pad = dilation * (kernel // 2)
        self.dwconv = nn.Conv1d(dim, dim, kernel, padding=pad, dilation=dilation, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        y = self.dwconv(x).transpose(1, 2)  # [B, T, C]
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y)))) * self.weight  # [B, T, C]
        return y.transpose(1, 2) + x  # [B, C, T]


class ConvStack(nn.Module):
    """Upstream ``DVAEDecoder``: bottleneck conv in, ConvNeXt blocks, 1x1 conv out; [B, idim, T] -> [B, odim, T]."""

    def __init__(self, config: ConvStackConfig):
        super().__init__()
        c = config
        self.conv_in = nn.Sequential(
            nn.Conv1d(c.idim, c.bn_dim, 3, 1, 1), nn.GELU(), nn.Conv1d(c.bn_dim, c.hidden, 3, 1, 1)
        )
        blocks = (ConvNeXtBlock(c.hidden, c.kernel, c.dilation) for _ in range(c.n_layer))
        self.decoder_block = nn.ModuleList(blocks)
        self.conv_out = nn.Conv1d(c.hidden, c.odim, 1, bias=False)

    def forward(self, x: Tensor, lengths: Tensor | None = None) -> Tensor:
        """``lengths`` [B] int32: each row's own number of frames; every convolution reads the frames after it
        as zeros, so a row's first ``lengths[b]`` outputs are those it has alone."""
        if lengths is None:
            x = self.conv_in(x)  # [B, hidden, T]
        else:
            first, act, second = self.conv_in
            x = second(mask_frames(act(first(mask_frames(x, lengths))), lengths))
        if fused_applies(x):  # the blocks channels last, on fused kernels (see audio.convnext)
            return conv_stack(self, x, lengths=lengths)
        for block in self.decoder_block:
            x = block(mask_frames(x, lengths))
        return self.conv_out(x)  # [B, odim, T]


class LogMel(nn.Module):
    """Log-magnitude mel spectrogram of 24 kHz audio: [S] -> [n_mels, S // hop + 1]."""

    def __init__(self, n_fft: int, n_mels: int):
        super().__init__()
        # torchaudio builds the filterbank with .item(), impossible on the meta device; it is small, so always
        # build it on the CPU (the module is moved to its device afterwards).
        with torch.device("cpu"):
            self.mel_spec = torchaudio.transforms.MelSpectrogram(
                sample_rate=SAMPLE_RATE, n_fft=n_fft, hop_length=HOP_LENGTH, n_mels=n_mels, center=True, power=1
            )

    def forward(self, wav: Tensor) -> Tensor:
        return torch.log(torch.clip(self.mel_spec(wav), min=1e-5))


class DVAE(nn.Module):
    """Codes [B, G*R, T] (or hidden states [B, 2*decoder.idim, T]) -> mel [B, n_mels, 2T]; wav -> codes."""

    def __init__(self, config: DVAEConfig):
        super().__init__()
        c = config
        self.config = c
        self.register_buffer("coef", torch.ones(1, c.n_mels, 1))  # per-mel scale of the (normalised) mels
        self.downsample_conv: nn.Sequential | None = None
        self.preprocessor_mel: LogMel | None = None
        self.encoder: ConvStack | None = None
        if c.encoder is not None:
            self.downsample_conv = nn.Sequential(
                nn.Conv1d(c.n_mels, c.dim, 3, 1, 1), nn.GELU(), nn.Conv1d(c.dim, c.dim, 4, 2, 1), nn.GELU()
            )
            self.preprocessor_mel = LogMel(c.n_fft, c.n_mels)
            self.encoder = ConvStack(c.encoder)
        self.decoder = ConvStack(c.decoder)
        self.out_conv = nn.Conv1d(c.dim, c.n_mels, 3, 1, 1, bias=False)
        self.vq_layer = GFSQ(c.vq_dim, c.levels, c.groups, c.residuals) if c.vq_dim is not None else None

    @classmethod
    def from_file(cls, path: str, device: torch.device | str) -> DVAE:
        """Load an upstream DVAE/Decoder safetensors file (sizes inferred), in eval mode on ``device``."""
        sd = read_safetensors(path)
        model = cls(DVAEConfig.from_state_dict(sd, os.path.basename(path)))
        model.load_state_dict(sd, strict=True)
        return model.to(device).eval()

    @torch.inference_mode()
    def decode(self, x: Tensor, lengths: Tensor | None = None) -> Tensor:
        """Codes [B, G*R, T] int (DVAE) or hidden states [B, 2*decoder.idim, T] float (Decoder)
        -> mel [B, n_mels, 2T]. Same as upstream ``DVAE.forward(x, "decode")``; ``x`` is left untouched.
        ``lengths`` [B] int32 on ``x``'s device: each row's own number of steps (the rest padding); row b's
        first ``2 * lengths[b]`` mel frames are then those it decodes to alone."""
        feats = self._embed(x) if self.vq_layer is not None else self._check_hiddens(x)  # [B, C, T]
        b, c, t = feats.shape
        # every step carries two mel frames: the two channel halves are consecutive frames
        feats = feats.reshape(b, 2, c // 2, t).permute(0, 2, 3, 1).flatten(2)  # [B, C/2, 2T]
        frames = None if lengths is None else 2 * lengths.to(feats.device)
        return self.out_conv(mask_frames(self.decoder(feats, frames), frames)) * self.coef  # [B, n_mels, 2T]

    @torch.inference_mode()
    def encode(self, wav: Tensor) -> Tensor:
        """Mono 24 kHz wav [S] float -> codes [G*R, T] int32 with T = (S // 256 + 1) // 2."""
        if self.encoder is None or self.vq_layer is None:
            raise ValueError("this DVAE has no encoder and quantizer (e.g. Decoder.safetensors): cannot encode")
        self._check_wav(wav)
        mel = self.preprocessor_mel(wav.to(self.coef.device, self.coef.dtype))  # [n_mels, F]
        x = self.downsample_conv(mel / self.coef.view(-1, 1)).unsqueeze(0)  # [1, dim, F // 2]
        return self.vq_layer.encode(self.encoder(x)).squeeze(0)  # [G*R, F // 2]

    def _embed(self, codes: Tensor) -> Tensor:
        n_vq = self.config.groups * self.config.residuals
        if codes.dim() != 3 or codes.shape[1] != n_vq or codes.is_floating_point() or codes.is_complex():
            got = f"{codes.dtype} {tuple(codes.shape)}"
            raise ValueError(f"codes must be an int tensor [B, {n_vq}, T], got {got}")
        size = self.vq_layer.codebook_size
        if ((codes < 0) | (codes >= size)).any():  # one device sync; the message's min/max only on error
            raise ValueError(f"codes must lie in [0, {size}), got [{int(codes.min())}, {int(codes.max())}]")
        return self.vq_layer.decode(codes.to(self.coef.device))  # [B, vq_dim, T]

    def _check_hiddens(self, x: Tensor) -> Tensor:
        width = 2 * self.config.decoder.idim
        if x.dim() != 3 or x.shape[1] != width or not x.is_floating_point():
            got = f"{x.dtype} {tuple(x.shape)}"
            raise ValueError(f"hidden states must be a float tensor [B, {width}, T], got {got}")
        return x.to(self.coef)  # [B, H, T]

    def _check_wav(self, wav: Tensor) -> None:
        if wav.dim() != 1 or not wav.is_floating_point():
            raise ValueError(f"wav must be a 1-D float tensor, got {wav.dtype} {tuple(wav.shape)}")
        # the centred STFT reflect-pads n_fft // 2 samples, which needs a longer signal
        if wav.numel() <= self.config.n_fft // 2:
            raise ValueError(f"wav must have more than {self.config.n_fft // 2} samples, got {wav.numel()}")
        if not torch.isfinite(wav).all():
            raise ValueError("wav contains NaN or infinite samples")
