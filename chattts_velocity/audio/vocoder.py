"""Vocos (mel [B, n_mels, F] -> 24 kHz wav [B, S]) built from the ``vocos`` package's own classes, with sizes
read off upstream's ``Vocos.safetensors``.

Not inferable from the tensors, fixed to upstream's values: hop length 256, sample rate 24 kHz (they shape no
weight), "center" padding, and the layer-scale init (overwritten by the checkpoint anyway).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor
from vocos import Vocos
from vocos.feature_extractors import MelSpectrogramFeatures
from vocos.heads import ISTFTHead
from vocos.models import VocosBackbone

from ..constants import HOP_LENGTH, SAMPLE_RATE
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


def vocos_decode(vocos: Vocos, mel: Tensor) -> Tensor:
    """``vocos.decode(mel)``: mel [B, n_mels, F] -> wav [B, S], the backbone on the fused kernels where they
    apply (``audio.convnext``), the head's spectrum from ``head_spectrum``."""
    return vocos.head.istft(head_spectrum(vocos.head, vocos_backbone(vocos.backbone, mel)))
