"""Random ChatTTS checkpoints in the exact upstream file layout (``make-checkpoint``), and the in-memory
full-size random model behind ``load_format="dummy"``. Weights are random: the audio is noise, the shapes and
code paths are real."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from safetensors.torch import save_file

from ..audio import DVAE, ConvStackConfig, DVAEConfig
from ..audio.vocoder import build_vocos
from ..constants import ASSET_FILES, HOP_LENGTH, SPK_STAT_FILE
from ..text import SpeakerStats, Tokenizer
from .gpt import ChatGPT
from .gpt_config import GPTConfig
from .tokenizer_files import write_tokenizer


@dataclass(frozen=True)
class CheckpointSize:
    """Module sizes of a random checkpoint."""

    gpt: GPTConfig
    """Llama core (``num_text_tokens`` is replaced by the tokenizer's size)."""
    dvae: DVAEConfig
    """DVAE (codes <-> mel, and wav -> codes)."""
    decoder: DVAEConfig
    """Decoder (hidden states -> mel)."""
    vocos: dict = field(default_factory=dict)
    """VocosBackbone sizes: dim, intermediate_dim, num_layers."""
    vocab_size: int | None = None
    """Tokenizer size; None keeps the builder's small vocabulary."""


TINY = CheckpointSize(
    gpt=GPTConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                  num_hidden_layers=2, max_position_embeddings=4096),
    dvae=DVAEConfig(decoder=ConvStackConfig(16, 16, 24, 2, 8), dim=16, encoder=ConvStackConfig(16, 32, 24, 2, 8),
                    vq_dim=32),
    decoder=DVAEConfig(decoder=ConvStackConfig(32, 32, 24, 2, 8), dim=32),
    vocos=dict(dim=32, intermediate_dim=64, num_layers=2),
)
FULL = CheckpointSize(
    gpt=GPTConfig(),
    dvae=DVAEConfig(decoder=ConvStackConfig(512, 512, 256, 12, 128), dim=512,
                    encoder=ConvStackConfig(512, 1024, 256, 12, 128), vq_dim=1024),
    decoder=DVAEConfig(decoder=ConvStackConfig(384, 384, 512, 12, 128), dim=384),
    vocos=dict(dim=512, intermediate_dim=1536, num_layers=8),
    vocab_size=21178,
)
SIZES = {"tiny": TINY, "full": FULL}


@dataclass
class RandomModules:
    config: GPTConfig
    gpt: ChatGPT
    dvae: torch.nn.Module
    decoder: torch.nn.Module
    vocos: torch.nn.Module
    tokenizer: object
    speaker_stats: object


def randomize_(module: torch.nn.Module, gen: torch.Generator, scale: float = 0.5) -> None:
    """Non-trivial random values everywhere (fan-in scaled; norm gains near 1), so no block is an identity."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and ("norm" in name or name.endswith("gamma")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=gen) / max(1, p.shape[-1]) ** 0.5)


def _vocos(sizes: dict):
    """The same construction as loading ``Vocos.safetensors`` (centred iSTFT), so random weights decode to
    the real model's wav lengths."""
    return build_vocos(dict(input_channels=100, n_fft=1024, hop_length=HOP_LENGTH, **sizes), torch.device("cpu"))


def build_modules(size: CheckpointSize, seed: int, tokenizer_dir: str) -> RandomModules:
    """Random modules of ``size``; the tokenizer is written to (and read back from) ``tokenizer_dir``."""
    gen = torch.Generator().manual_seed(seed)
    n_text = write_tokenizer(tokenizer_dir, size.vocab_size)
    fields = {k: getattr(size.gpt, k) for k in size.gpt.__dataclass_fields__}
    config = GPTConfig(**{**fields, "num_text_tokens": n_text})
    gpt = ChatGPT(config)
    randomize_(gpt.llama, gen, scale=1.0)  # the generator's first draws: random_llama_state repeats them
    randomize_(gpt.embed, gen, scale=3.0)
    with torch.no_grad():  # a louder EOS row: random models then end sentences instead of running to the cap
        for head in gpt.embed.head_code:
            head.parametrizations.weight.original0[-1] *= 2.5
    dvae, decoder = DVAE(size.dvae), DVAE(size.decoder)
    vocos = _vocos(size.vocos)
    for m in (dvae, decoder, vocos):
        randomize_(m, gen)
    for m in (dvae, decoder):
        m.coef.copy_(0.5 + torch.rand(m.coef.shape, generator=gen))
    h = config.hidden_size
    stats = SpeakerStats((0.5 + torch.rand(h, generator=gen)).half(), (0.2 * torch.randn(h, generator=gen)).half())
    return RandomModules(config, gpt, dvae, decoder, vocos, Tokenizer(tokenizer_dir), stats)


def random_llama_state(config: GPTConfig, seed: int) -> dict[str, torch.Tensor]:
    """``build_modules``' Llama weights for ``config`` and ``seed`` again, without the rest (a dummy model's
    ``ChatGPT.llama_source``)."""
    from transformers import LlamaModel

    llama = LlamaModel(config.to_llama_config())
    del llama.embed_tokens
    randomize_(llama, torch.Generator().manual_seed(seed), scale=1.0)
    return llama.state_dict()


def _save(state: dict[str, torch.Tensor], path: str) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, path)


def write_checkpoint(root: str | os.PathLike, size: str = "tiny", seed: int = 0) -> str:
    """Write a random checkpoint under ``root`` in the upstream layout (``asset/gpt``, ``asset/*.safetensors``,
    ``asset/tokenizer``) plus ``asset/spk_stat.safetensors`` so ``sample_random_speaker()`` works on it."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    root = os.fspath(root)
    gpt_dir = os.path.join(root, ASSET_FILES["gpt"])
    os.makedirs(gpt_dir, exist_ok=True)
    mods = build_modules(SIZES[size], seed, os.path.join(root, ASSET_FILES["tokenizer"]))
    with open(os.path.join(gpt_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(mods.config.to_json_dict(), f, indent=2)
    _save(mods.gpt.llama.state_dict(), os.path.join(gpt_dir, "model.safetensors"))
    _save(mods.gpt.embed.state_dict(), os.path.join(root, ASSET_FILES["embed"]))
    _save(mods.dvae.state_dict(), os.path.join(root, ASSET_FILES["dvae"]))
    _save(mods.decoder.state_dict(), os.path.join(root, ASSET_FILES["decoder"]))
    _save(mods.vocos.state_dict(), os.path.join(root, ASSET_FILES["vocos"]))
    stats = mods.speaker_stats
    _save({"std": stats.std, "mean": stats.mean}, os.path.join(root, SPK_STAT_FILE))
    return root
