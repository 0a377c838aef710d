"""Vocos (mel [B, n_mels, F] -> 24 kHz wav [B, S]) built from the ``vocos`` package's own classes, with sizes
read off upstream's ``Vocos.safetensors``.

Not inferable from the tensors, fixed to upstream's values: hop length 256, sample rate 24 kHz (they shape no
weight), "center" padding, and the layer-scale init (overwritten by the checkpoint anyway).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor
from vocos import Vocos
from vocos.feature_extractors import MelSpectrogramFeatures
from vocos.heads import ISTFTHead
from vocos.models import VocosBackbone

from ..constants import HOP_LENGTH, SAMPLE_RATE
from ..kernels.convnext import time_mask
from ..weights import check_state_dict, count_layers, read_safetensors, require
from .convnext import vocos_backbone


def vocos_state_dict_config(sd: dict[str, Tensor], name: str = "Vocos.safetensors") -> dict[str, int]:
    """Sizes of a Vocos state dict: input_channels (= n_mels), dim, intermediate_dim, num_layers, n_fft,
    hop_length. Every tensor of ``sd`` is checked against them; a mismatch raises ``ValueError`` naming the key."""
    dim, input_channels, _ = require(sd, "backbone.embed.weight", 3, name).shape
    # the head predicts n_fft/2+1 magnitudes and as many phases
    n_fft = require(sd, "head.out.weight", 2, name).shape[0] - 2
    if n_fft <= 0 or n_fft % 2:
        raise ValueError(f"{name}: head.out.weight has {n_fft + 2} outputs, expected an even n_fft + 2")
    config = dict(
        input_channels=input_channels,
        dim=dim,
        intermediate_dim=require(sd, "backbone.convnext.0.pwconv1.weight", 2, name).shape[0],
        num_layers=count_layers(sd, "backbone.convnext", name),
        n_fft=n_fft,
        hop_length=HOP_LENGTH,
    )
    check_state_dict(build_vocos(config, torch.device("meta")), sd, name)
    return config


def load_vocos(path: str, device: torch.device | str) -> Vocos:
    """Load an upstream Vocos safetensors file (sizes inferred), in eval mode on ``device``."""
    sd = read_safetensors(path)
    vocos = build_vocos(vocos_state_dict_config(sd, os.path.basename(path)), torch.device("cpu"))
    vocos.load_state_dict(sd, strict=True)
    return vocos.to(device).eval()


def build_vocos(config: dict[str, int], device: torch.device) -> Vocos:
    """An untrained Vocos of ``config``'s sizes (``vocos_state_dict_config``), as upstream builds it."""
    # torchaudio builds the mel filterbank with .item(), impossible on the meta device; it is small: use the CPU
    features = MelSpectrogramFeatures(
        sample_rate=SAMPLE_RATE, n_fft=config["n_fft"], hop_length=config["hop_length"],
        n_mels=config["input_channels"], padding="center",
    )
    with device:
        backbone = VocosBackbone(
            input_channels=config["input_channels"], dim=config["dim"],
            intermediate_dim=config["intermediate_dim"], num_layers=config["num_layers"],
        )
        head = ISTFTHead(
            dim=config["dim"], n_fft=config["n_fft"], hop_length=config["hop_length"], padding="center"
        )
    return Vocos(feature_extractor=features, backbone=backbone, head=head)


def head_spectrum(head: ISTFTHead, x: Tensor) -> Tensor:
    """Vocos's ``ISTFTHead`` up to its iSTFT: backbone features [B, F, dim] -> complex spectrum
    [B, n_fft/2 + 1, F]. The same values as the head's own ``mag * (cos + 1j * sin)``, built with
    ``torch.complex`` from two real products: the promotion of real tensors to complex there makes several
    complex temporaries, the costliest line of an eager wav decode on a CPU."""
    mag, phase = head.out(x).transpose(1, 2).chunk(2, dim=1)
    mag = torch.exp(mag).clip(max=1e2)  # as the head: a safeguard against huge magnitudes
    return torch.complex(mag * torch.cos(phase), mag * torch.sin(phase))


def istft_center(spec: Tensor, n_fft: int, hop: int, window: Tensor, envelope: Tensor | None = None,
                 frames: Tensor | None = None) -> Tensor:
    """``torch.istft(spec, n_fft, hop, n_fft, window, center=True)`` for complex ``spec`` [B, n_fft/2+1, T] ->
    [B, hop * (T - 1)], without the host-side envelope check (``envelope``: ``window_envelope``'s result, or
    None to compute it here). ``frames`` [B] int32: row b as if it had only its first ``frames[b]`` frames
    (its first ``hop * (frames[b] - 1)`` samples are then its own; the rest are of no use)."""
    signal = torch.fft.irfft(spec, n_fft, dim=1, norm="backward") * window[None, :, None]  # [B, n_fft, T]
    t = spec.shape[-1]
    size = n_fft + hop * (t - 1)
    fold = dict(output_size=(1, size), kernel_size=(1, n_fft), stride=(1, hop))
    if frames is not None:
        valid = time_mask(frames.to(spec.device), t)[:, None, :]  # [B, 1, T]
        signal = signal.masked_fill(~valid, 0.0)
        envelope = F.fold(window.square()[None, :, None] * valid, **fold)[:, 0, 0]  # [B, size]
    elif envelope is None:
        envelope = window_envelope(window, t, hop)
    wav = F.fold(signal, **fold)[:, 0, 0]  # [B, size]
    pad = n_fft // 2
    wav, envelope = wav[:, pad : size - pad], envelope[..., pad : size - pad]
    return wav / envelope if frames is None else torch.where(envelope > 1e-11, wav / envelope, 0.0)


def window_envelope(window: Tensor, frames: int, hop: int) -> Tensor:
    """Overlap-added squared window of ``frames`` frames: [n_fft + hop * (frames - 1)]."""
    n_fft = window.shape[0]
    sq = window.square()[None, :, None].expand(1, n_fft, frames)
    return F.fold(sq, output_size=(1, n_fft + hop * (frames - 1)), kernel_size=(1, n_fft), stride=(1, hop))[0, 0, 0]


def vocos_decode(vocos: Vocos, mel: Tensor, frames: Tensor | None = None) -> Tensor:
    """``vocos.decode(mel)``: mel [B, n_mels, F] -> wav [B, S], the backbone on the fused kernels where they
    apply (``audio.convnext``), the head's spectrum from ``head_spectrum``. ``frames`` [B] int32: each row's
    own number of mel frames, the rest padding: row b's first ``hop * (frames[b] - 1)`` samples are then its
    wav alone (``istft_center``)."""
    spectrum = head_spectrum(vocos.head, vocos_backbone(vocos.backbone, mel, lengths=frames))
    istft = vocos.head.istft
    if frames is None:
        return istft(spectrum)
    if istft.padding != "center" or istft.win_length != istft.n_fft:
        raise ValueError("rows of their own lengths need a centred iSTFT with its window as long as n_fft")
    return istft_center(spectrum, istft.n_fft, istft.hop_length, istft.window, frames=frames)
