"""Tiny random ChatTTS checkpoints written by upstream's own classes (package ``chattts``), and an upstream
``Chat`` loaded on them: the oracle for parity tests. Nothing here is shipped; weights live in temp dirs."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import numpy as np
import pybase16384 as b14
import torch
from safetensors.torch import save_file

from chattts_velocity.model.checkpoint import randomize_
from chattts_velocity.model.tokenizer_files import write_tokenizer

HIDDEN = 64
DVAE_DIM = 16
VQ_DIM = 32
SPK_STAT_FILE = "spk_stat.safetensors"


def _save(module: torch.nn.Module, path: str) -> None:
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, path)


def upstream_configure(chat, spk_stat: str, n_text: int) -> None:
    """Point an upstream ``ChatTTS.Chat``'s config at the tiny sizes (it hard-codes the full ones)."""
    cfg = chat.config
    cfg.gpt.hidden_size = HIDDEN
    cfg.gpt.intermediate_size = 128
    cfg.gpt.num_attention_heads = 4
    cfg.gpt.num_hidden_layers = 2
    cfg.gpt.max_position_embeddings = 512
    cfg.embed.hidden_size = HIDDEN
    cfg.gpt.num_text_tokens = cfg.embed.num_text_tokens = n_text
    for c in (cfg.dvae.decoder,):
        c.idim, c.odim, c.hidden, c.n_layer, c.bn_dim = DVAE_DIM, DVAE_DIM, 24, 2, 8
    enc = cfg.dvae.encoder
    enc.idim, enc.odim, enc.hidden, enc.n_layer, enc.bn_dim = DVAE_DIM, VQ_DIM, 24, 2, 8
    cfg.dvae.vq.dim = VQ_DIM
    dec = cfg.decoder
    dec.idim, dec.odim, dec.hidden, dec.n_layer, dec.bn_dim = HIDDEN // 2, HIDDEN // 2, 24, 2, 8
    cfg.vocos.backbone.init_args.dim = 32
    cfg.vocos.backbone.init_args.intermediate_dim = 64
    cfg.vocos.backbone.init_args.num_layers = 2
    cfg.vocos.head.init_args.dim = 32
    cfg.spk_stat = spk_stat


def write_upstream_checkpoint(root: str, seed: int = 0) -> str:
    """Write a tiny checkpoint in the exact upstream layout under ``root`` with upstream's classes; returns ``root``."""
    import ChatTTS
    from ChatTTS.model.dvae import DVAE
    from ChatTTS.model.embed import Embed
    from transformers import LlamaConfig, LlamaModel
    from vocos import Vocos
    from vocos.pretrained import instantiate_class

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    asset = os.path.join(root, "asset")
    os.makedirs(asset, exist_ok=True)
    n_text = write_tokenizer(os.path.join(asset, "tokenizer"))

    std = 0.5 + torch.rand(HIDDEN, generator=gen)
    mean = 0.2 * torch.randn(HIDDEN, generator=gen)
    spk_stat = b14.encode_to_string(torch.cat([std, mean]).to(torch.float16).numpy().tobytes())
    save_file({"std": std.to(torch.float16), "mean": mean.to(torch.float16)}, os.path.join(asset, SPK_STAT_FILE))

    chat = ChatTTS.Chat()
    upstream_configure(chat, spk_stat, n_text)
    cfg = chat.config

    gcfg = asdict(cfg.gpt)
    llama = LlamaModel(
        LlamaConfig(
            hidden_size=gcfg["hidden_size"], intermediate_size=gcfg["intermediate_size"],
            num_attention_heads=gcfg["num_attention_heads"], num_hidden_layers=gcfg["num_hidden_layers"],
            max_position_embeddings=gcfg["max_position_embeddings"], num_key_value_heads=gcfg["num_attention_heads"],
            rms_norm_eps=1e-6, vocab_size=32, num_audio_tokens=626, num_text_tokens=n_text, num_vq=4,
            spk_emb_dim=192, spk_KL=False, use_cache=False,
        )
    )
    randomize_(llama, gen, scale=1.0)
    llama.save_pretrained(os.path.join(asset, "gpt"), safe_serialization=True)

    embed = Embed(HIDDEN, 626, n_text, 4)
    randomize_(embed, gen, scale=3.0)
    with torch.no_grad():  # a louder EOS row so that sequences end at different steps within a few dozen
        for head in embed.head_code:
            head.parametrizations.weight.original0[-1] *= 2.5
    _save(embed, os.path.join(asset, "Embed.safetensors"))

    dvae = DVAE(
        decoder_config=asdict(cfg.dvae.decoder), encoder_config=asdict(cfg.dvae.encoder),
        vq_config=asdict(cfg.dvae.vq), dim=cfg.dvae.decoder.idim,
    )
    randomize_(dvae, gen)
    _save(dvae, os.path.join(asset, "DVAE.safetensors"))

    decoder = DVAE(decoder_config=asdict(cfg.decoder), dim=cfg.decoder.idim)
    randomize_(decoder, gen)
    _save(decoder, os.path.join(asset, "Decoder.safetensors"))

    vocos = Vocos(
        feature_extractor=instantiate_class(args=(), init=asdict(cfg.vocos.feature_extractor)),
        backbone=instantiate_class(args=(), init=asdict(cfg.vocos.backbone)),
        head=instantiate_class(args=(), init=asdict(cfg.vocos.head)),
    )
    randomize_(vocos, gen)
    _save(vocos, os.path.join(asset, "Vocos.safetensors"))
    return root


def load_upstream(root: str, device: str = "cpu"):
    """An upstream ``ChatTTS.Chat`` loaded (CPU by default) from a checkpoint written by :func:`write_upstream_checkpoint`."""
    import ChatTTS
    from safetensors.torch import load_file

    stat = load_file(os.path.join(root, "asset", SPK_STAT_FILE))
    spk_stat = b14.encode_to_string(torch.cat([stat["std"], stat["mean"]]).numpy().tobytes())
    chat = ChatTTS.Chat()
    with open(os.path.join(root, "asset", "gpt", "config.json")) as f:
        n_text = json.load(f)["num_text_tokens"]
    upstream_configure(chat, spk_stat, n_text)
    paths = {k: os.path.join(root, v) for k, v in asdict(chat.config.path).items()}
    assert chat._load(device=torch.device(device), **paths)
    return chat


__all__ = ["write_upstream_checkpoint", "load_upstream", "np"]
