"""``Chat.config``: upstream ChatTTS's ``Config`` tree (same nesting, field names and defaults, so
``dataclasses.asdict`` of either gives the same dict), filled from the loaded checkpoint.

Upstream hard-codes the full-size model in its config and reads the files with it; here every size comes from
the files, and the config only reports them. It is frozen: setting a field could not change the loaded model.
The defaults (``Chat.config`` before ``load``) are upstream's, the released model's sizes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pybase16384 as b14
import torch

from .audio import DVAE, ConvStackConfig, vocos_state_dict_config
from .constants import ASSET_FILES, SAMPLE_RATE
from .model.loader import LoadedModel
from .text import SpeakerStats


@dataclass(frozen=True)
class AssetPaths:
    """Where each part lies, relative to the model folder (``Chat.download_models``'s answer)."""

    vocos_ckpt_path: str = ASSET_FILES["vocos"]
    dvae_ckpt_path: str = ASSET_FILES["dvae"]
    gpt_ckpt_path: str = ASSET_FILES["gpt"]
    decoder_ckpt_path: str = ASSET_FILES["decoder"]
    tokenizer_path: str = ASSET_FILES["tokenizer"]
    embed_path: str = ASSET_FILES["embed"]


@dataclass(frozen=True)
class ConvSizes:
    """One conv stack of the DVAE or the Decoder (upstream's ``Decoder`` config)."""

    idim: int = 384
    odim: int = 384
    hidden: int = 512
    n_layer: int = 12
    bn_dim: int = 128

    @classmethod
    def of(cls, stack: ConvStackConfig) -> ConvSizes:
        return cls(stack.idim, stack.odim, stack.hidden, stack.n_layer, stack.bn_dim)


@dataclass(frozen=True)
class VQSizes:
    """The DVAE's grouped residual FSQ: width, levels per dimension, groups ``G`` and residual steps ``R``."""

    dim: int = 1024
    levels: tuple = (5, 5, 5, 5)
    G: int = 2
    R: int = 2


@dataclass(frozen=True)
class DVAESizes:
    """The DVAE (audio codes <-> mel)."""

    encoder: ConvSizes | None = ConvSizes(512, 1024, 256, 12, 128)
    decoder: ConvSizes = ConvSizes(512, 512, 256, 12, 128)
    vq: VQSizes = VQSizes()


@dataclass(frozen=True)
class GPTSizes:
    """The GPT (upstream's ``gpt`` config; ``use_cache``, ``spk_emb_dim`` and ``spk_KL`` are upstream's fixed
    values, which no weight depends on)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_attention_heads: int = 12
    num_hidden_layers: int = 20
    use_cache: bool = False
    max_position_embeddings: int = 4096
    spk_emb_dim: int = 192
    spk_KL: bool = False
    num_audio_tokens: int = 626
    num_text_tokens: int = 21178
    num_vq: int = 4


@dataclass(frozen=True)
class EmbedSizes:
    """The input embeddings and output heads (``Embed.safetensors``)."""

    hidden_size: int = 768
    num_audio_tokens: int = 626
    num_text_tokens: int = 21178
    num_vq: int = 4


@dataclass(frozen=True)
class MelArgs:
    sample_rate: int = SAMPLE_RATE
    n_fft: int = 1024
    hop_length: int = 256
    n_mels: int = 100
    padding: str = "center"


@dataclass(frozen=True)
class BackboneArgs:
    input_channels: int = 100
    dim: int = 512
    intermediate_dim: int = 1536
    num_layers: int = 8


@dataclass(frozen=True)
class HeadArgs:
    dim: int = 512
    n_fft: int = 1024
    hop_length: int = 256
    padding: str = "center"


@dataclass(frozen=True)
class ClassInit:
    """A ``vocos`` class and its arguments, in the form ``vocos.pretrained.instantiate_class`` takes (asdict)."""

    class_path: str
    init_args: MelArgs | BackboneArgs | HeadArgs


@dataclass(frozen=True)
class VocosSizes:
    """The vocoder (mel -> wav)."""

    feature_extractor: ClassInit = ClassInit("vocos.feature_extractors.MelSpectrogramFeatures", MelArgs())
    backbone: ClassInit = ClassInit("vocos.models.VocosBackbone", BackboneArgs())
    head: ClassInit = ClassInit("vocos.heads.ISTFTHead", HeadArgs())


def _builtin_spk_stat() -> str:
    """Upstream's default ``spk_stat``: the released model's speaker statistics as base16384 text."""
    return spk_stat_text(SpeakerStats.builtin_768())


@dataclass(frozen=True)
class UpstreamConfig:
    """Upstream's ``Config``: ``path``, ``decoder``, ``dvae``, ``gpt``, ``embed``, ``vocos``, ``spk_stat``."""

    path: AssetPaths = AssetPaths()
    decoder: ConvSizes = ConvSizes()
    dvae: DVAESizes = DVAESizes()
    gpt: GPTSizes = GPTSizes()
    embed: EmbedSizes = EmbedSizes()
    vocos: VocosSizes = VocosSizes()
    spk_stat: str | None = field(default_factory=_builtin_spk_stat)
    """The speaker statistics (float16 std then mean) as base16384 text; None when the checkpoint has none."""

    @classmethod
    def of(cls, model: LoadedModel) -> UpstreamConfig:
        """The config of a loaded model, every size read off its modules."""
        cfg = model.config
        sizes = dict(hidden_size=cfg.hidden_size, num_audio_tokens=cfg.num_audio_tokens,
                     num_text_tokens=cfg.num_text_tokens, num_vq=cfg.num_vq)
        gpt = GPTSizes(intermediate_size=cfg.intermediate_size, num_attention_heads=cfg.num_attention_heads,
                       num_hidden_layers=cfg.num_hidden_layers,
                       max_position_embeddings=cfg.max_position_embeddings, **sizes)
        stats = model.speaker_stats
        return cls(decoder=ConvSizes.of(model.decoder.config.decoder), dvae=_dvae_sizes(model.dvae), gpt=gpt,
                   embed=EmbedSizes(**sizes), vocos=_vocos_sizes(model.vocos),
                   spk_stat=None if stats is None else spk_stat_text(stats))


def spk_stat_text(stats: SpeakerStats) -> str:
    """``stats`` in upstream's ``spk_stat`` form: base16384 of the float16 std then mean."""
    return b14.encode_to_string(torch.cat([stats.std, stats.mean]).cpu().numpy().tobytes())


def _dvae_sizes(dvae: DVAE) -> DVAESizes:
    c = dvae.config
    vq = VQSizes(c.vq_dim, tuple(c.levels), c.groups, c.residuals) if c.vq_dim is not None else VQSizes()
    return DVAESizes(encoder=None if c.encoder is None else ConvSizes.of(c.encoder),
                     decoder=ConvSizes.of(c.decoder), vq=vq)


def _vocos_sizes(vocos: torch.nn.Module) -> VocosSizes:
    c = vocos_state_dict_config(vocos.state_dict())
    stft = dict(n_fft=c["n_fft"], hop_length=c["hop_length"])
    default = VocosSizes()
    return VocosSizes(
        feature_extractor=dataclasses.replace(default.feature_extractor,
                                              init_args=MelArgs(n_mels=c["input_channels"], **stft)),
        backbone=dataclasses.replace(default.backbone, init_args=BackboneArgs(
            c["input_channels"], c["dim"], c["intermediate_dim"], c["num_layers"])),
        head=dataclasses.replace(default.head, init_args=HeadArgs(dim=c["dim"], **stft)),
    )
