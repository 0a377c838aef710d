"""Upstream ChatTTS's public attributes of a loaded ``Chat`` (``tokenizer``, ``speaker``, ``config``, ``gpt``,
``embed``, ``dvae``, ``decoder``, ``vocos``, ``device_gpt``, ``coef``) and its ``download_models``, so that
scripts written against upstream (its own regression scripts among them) run unchanged.

Each attribute is built on first use from the loaded model (see ``upstream_modules``) and kept until the next
``load``. Before ``load`` (and after ``unload``) they are absent, as upstream's are: an ``AttributeError`` says
to load first. ``config`` exists before ``load`` too, with upstream's defaults.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from vocos import Vocos

from .model.loader import LoadedModel, resolve_model_dir
from .upstream_config import UpstreamConfig
from .upstream_modules import UpstreamDVAE, UpstreamEmbed, UpstreamGPT, UpstreamSpeaker, UpstreamTokenizer


class UpstreamAttributes:
    """Mixin of ``Chat``, which provides ``model`` (the ``LoadedModel`` or None), ``device`` and
    ``sample_random_speaker``."""

    @property
    def tokenizer(self) -> UpstreamTokenizer:
        """Upstream's ``Tokenizer``: ``encode(texts, num_vq, prompt=, device=)`` and ``decode(ids)``."""
        return self._upstream("tokenizer", lambda m: UpstreamTokenizer(m.tokenizer))

    @property
    def speaker(self) -> UpstreamSpeaker:
        """Upstream's ``Speaker``: ``sample_random``, ``apply``, ``decorate_code_prompts``, ``encode_prompt``..."""
        return self._upstream("speaker", lambda m: UpstreamSpeaker(self.sample_random_speaker,
                                                                   m.config.hidden_size, m.speaker_stats))

    @property
    def config(self) -> UpstreamConfig:
        """Upstream's ``Config`` tree with the loaded model's sizes (upstream's defaults before ``load``)."""
        if self.model is None:
            return UpstreamConfig()
        return self._upstream("config", UpstreamConfig.of)

    @property
    def gpt(self) -> UpstreamGPT:
        """Upstream's ``GPT`` module: the Llama core ``gpt.gpt``, the embedding and head callables, the sizes.
        Generation runs in the engine (``infer``, ``pipeline``): ``gpt.generate`` says so."""
        return self._upstream("gpt", lambda m: UpstreamGPT(m.gpt, self.device))

    @property
    def embed(self) -> UpstreamEmbed:
        """Upstream's ``Embed``: ``embed(input_ids, text_mask)`` -> [B, T, H], and the embeddings and heads."""
        return self._upstream("embed", lambda m: UpstreamEmbed(m.gpt.embed))

    @property
    def dvae(self) -> UpstreamDVAE:
        """Upstream's ``DVAE``: ``dvae(codes)`` -> mel, ``dvae(wav, "encode")`` -> codes."""
        return self._upstream("dvae", lambda m: UpstreamDVAE(m.dvae))

    @property
    def decoder(self) -> UpstreamDVAE:
        """Upstream's Decoder: ``decoder(hiddens)`` -> mel."""
        return self._upstream("decoder", lambda m: UpstreamDVAE(m.decoder))

    @property
    def vocos(self) -> Vocos:
        """The ``vocos.Vocos`` vocoder itself: ``vocos.decode(mel)`` -> wav."""
        return self._upstream("vocos", lambda m: m.vocos)

    @property
    def device_gpt(self) -> torch.device:
        """The device the GPT's inputs go to (``tokenizer.encode(..., device=chat.device_gpt)``)."""
        return self._upstream("device_gpt", lambda m: self.device)

    @property
    def coef(self) -> str:
        """The DVAE's mel scales as a base16384 string (what ``load(coef=...)`` takes)."""
        return str(self.dvae)

    def download_models(self, source: str = "local", force_redownload: bool = False,
                        custom_path: str | os.PathLike | None = None) -> str:
        """The folder holding ``asset/`` for ``source`` ("huggingface", "local" or "custom"; see
        ``model.loader.resolve_model_dir``), downloading where the source says to; ``load`` reads from it.
        Unlike upstream, which logs and returns None, a folder that cannot be had raises
        ``ModelNotFoundError`` saying where it looked and how to get the weights."""
        return str(resolve_model_dir(source, custom_path, force_redownload))

    def _upstream(self, name: str, build: Callable[[LoadedModel], object]):
        """The attribute ``name`` of the loaded model, built on first use and kept while that model is loaded."""
        model = self.model
        if model is None:
            raise AttributeError(f"Chat.{name} exists once a model is loaded: call Chat.load() first")
        cache = self.__dict__.get("_upstream_cache")
        if cache is None or cache[0] is not model:
            cache = (model, {})
            self._upstream_cache = cache
        parts = cache[1]
        if name not in parts:
            parts[name] = build(model)
        return parts[name]
