"""Upstream ChatTTS's part objects (``chat.tokenizer``, ``chat.speaker``, ``chat.gpt``, ``chat.embed``,
``chat.dvae``, ``chat.decoder``) as faces over our loaded model: the same methods and results on the same
weights, each running our own code (nothing is loaded twice).

Unlike upstream, ``speaker.decorate_code_prompts`` leaves the caller's list untouched, and malformed speaker
strings, codes or wavs raise a ``ValueError`` that says what is wrong. Upstream's GPT generation loop has no
counterpart here (the engine replaces it): its names raise an ``AttributeError`` that names the replacement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pybase16384 as b14
import torch
from torch import nn

from .model.embed import Embed
from .model.gpt import ChatGPT
from .text import (
    SpeakerStats,
    Tokenizer,
    apply_speaker,
    decode_prompt,
    decode_speaker,
    decorate_code_prompts,
    decorate_text_prompts,
    encode_prompt,
    encode_speaker,
    speaker_vector,
)

GPT_REPLACED = (
    "chat.gpt.{name}: chattts_velocity's GPT runs in its engine, not in upstream's GPT module: generate with "
    "chat.infer(...) (use_velocity=False runs upstream's decode loop step for step), or submit requests with "
    "their own sampling settings through chat.pipeline. chat.gpt.gpt is the Llama core, chat.embed the "
    "embeddings and heads, chat.tokenizer and chat.speaker build the inputs."
)


class UpstreamTokenizer:
    """Upstream's ``Tokenizer`` over ours: ``encode`` gives the same tensors, ``decode`` the same texts."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.len = tokenizer.len
        self.spk_emb_ids = tokenizer.spk_emb_ids
        self.break_0_ids = tokenizer.break_0_ids
        self.eos_token = tokenizer.eos_token

    def encode(self, text: list[str], num_vq: int, prompt: torch.Tensor | None = None,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded ``input_ids`` [B, T, num_vq], ``attention_mask`` [B, T], ``text_mask`` [B, T]."""
        return self.tokenizer.encode(text, num_vq, prompt=prompt, device=device)

    def decode(self, sequences, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None,
               **kwargs) -> list[str]:
        """Text of each id sequence (upstream's defaults: special tokens kept)."""
        return self.tokenizer.decode(sequences, skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)


class UpstreamSpeaker:
    """Upstream's ``Speaker``: random speakers, the ``[spk_emb]`` overwrite, prompts and the string formats."""

    def __init__(self, sample: Callable[[], str], dim: int, stats: SpeakerStats | None):
        self._sample = sample
        self.dim = dim
        self.std = None if stats is None else stats.std
        self.mean = None if stats is None else stats.mean

    def sample_random(self) -> str:
        """A random speaker string (``Chat.sample_random_speaker``: the same draw from torch's global RNG)."""
        return self._sample()

    @torch.inference_mode()
    def apply(self, emb: torch.Tensor, spk_emb: str | torch.Tensor, input_ids: torch.Tensor, spk_emb_ids: int,
              device: torch.device | str | None = None, inplace: bool = True) -> torch.Tensor:
        """``emb`` [B, T, H] with the unit speaker vector at the ``[spk_emb]`` positions of ``input_ids``
        [B, T, num_vq]; in place unless ``inplace=False``. ``device`` is accepted for compatibility: the vector
        goes where ``emb`` is."""
        out = emb if inplace else emb.clone()
        return apply_speaker(out, input_ids, spk_emb_ids, speaker_vector(spk_emb, self.dim))

    @staticmethod
    def decorate_code_prompts(text: list[str], prompt: str, txt_smp: str | None, spk_emb: str | None) -> list[str]:
        """``[Stts][spk_emb|empty_spk]{txt_smp}{prompt}{text}[Ptts]`` per text."""
        return decorate_code_prompts(text, prompt, txt_smp, spk_emb is not None)

    @staticmethod
    def decorate_text_prompts(text: list[str], prompt: str) -> list[str]:
        """``[Sbreak]{text}[Pbreak]{prompt}`` per text."""
        return decorate_text_prompts(text, prompt)

    @staticmethod
    def encode_prompt(prompt: torch.Tensor) -> str:
        """The ``spk_smp`` string of audio codes [num_vq, T]."""
        return encode_prompt(prompt)

    @staticmethod
    def decode_prompt(prompt: str) -> torch.Tensor:
        """The int32 audio codes [num_vq, T] of a ``spk_smp`` string."""
        return decode_prompt(prompt)

    # upstream's names for the speaker-string converters, which scripts use to turn saved speaker tensors into
    # spk_emb strings
    @staticmethod
    def _encode(spk_emb: torch.Tensor) -> str:
        return encode_speaker(spk_emb)

    @staticmethod
    def _decode(spk_emb: str) -> np.ndarray:
        return decode_speaker(spk_emb).numpy()


@dataclass(repr=False, eq=False)
class GenerationOutputs:
    """Upstream's ``GPT.GenerationOutputs``."""

    ids: list[torch.Tensor]
    attentions: list
    hiddens: list[torch.Tensor]

    def destroy(self) -> None:
        self.ids, self.attentions, self.hiddens = [], [], []


class UpstreamGPT(nn.Module):
    """Upstream's ``GPT`` module as far as it is data: the Llama core ``gpt`` (same state dict), the embedding
    and head callables, the sizes and devices. Its generation has no counterpart (see ``GPT_REPLACED``)."""

    GenerationOutputs = GenerationOutputs
    is_vllm = False
    is_te_llama = False
    use_flash_attn = False

    def __init__(self, gpt: ChatGPT, device: torch.device):
        super().__init__()
        gpt.ensure_llama()  # the engine may hold its own copy: the Llama's weights come back for the caller
        self.gpt = gpt.llama
        self.device = self.device_gpt = device
        self.num_vq = gpt.config.num_vq
        self.num_audio_tokens = gpt.config.num_audio_tokens
        self.num_text_tokens = gpt.config.num_text_tokens
        # callables, not submodules (as upstream): the state dict is the Llama's alone
        embed = gpt.embed
        self.emb_code = [m.__call__ for m in embed.emb_code]
        self.emb_text = embed.emb_text.__call__
        self.head_text = embed.head_text.__call__
        self.head_code = [m.__call__ for m in embed.head_code]

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            raise AttributeError(GPT_REPLACED.format(name=name)) from None

    def forward(self, *args, **kwargs):
        raise NotImplementedError(GPT_REPLACED.format(name="forward"))

    # upstream's name: its regression scripts call it to cut generated ids out of a batch
    @torch.no_grad()
    def _prepare_generation_outputs(self, inputs_ids: torch.Tensor, start_idx: int, end_idx: torch.Tensor,
                                    attentions: list, hiddens: list[torch.Tensor],
                                    infer_text: bool) -> GenerationOutputs:
        """Row ``b`` of ``inputs_ids`` [B, T, num_vq] from ``start_idx`` for ``end_idx[b]`` steps (codebook 0
        only with ``infer_text``), and the first ``end_idx[b]`` of the per-step ``hiddens`` [B, H] each."""
        ends = end_idx.int().tolist()
        ids = [inputs_ids[b].narrow(0, start_idx, n) for b, n in enumerate(ends)]
        if infer_text:
            ids = [x[:, 0] for x in ids]
        stacked = torch.stack(hiddens, 1) if hiddens else None  # [B, steps, H]
        rows = [] if stacked is None else [stacked[b, :n] for b, n in enumerate(ends)]
        return GenerationOutputs(ids=ids, attentions=attentions, hiddens=rows)


class ModuleView:
    """One of our modules behind upstream's call signature; every other name is the module's own (parameter
    and buffer names equal upstream's state-dict keys)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __getattr__(self, name: str):
        if name == "module":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.module, name)


class UpstreamEmbed(ModuleView):
    """Upstream's ``Embed``: ``embed(input_ids, text_mask)`` -> [B, T, H] on the embeddings' device."""

    def __init__(self, embed: Embed):
        super().__init__(embed)
        self.model_dim = embed.emb_text.embedding_dim
        self.num_audio_tokens = embed.emb_code[0].num_embeddings

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        device = self.module.emb_text.weight.device
        return self.module(input_ids.to(device), text_mask.to(device))

    forward = __call__


class UpstreamDVAE(ModuleView):
    """Upstream's ``DVAE`` (``chat.dvae``) and Decoder (``chat.decoder``): ``dvae(codes)`` or
    ``decoder(hiddens)`` -> mel [B, n_mels, 2T]; ``dvae(wav, "encode")`` -> codes [1, num_vq, T];
    ``str(dvae)`` is its ``coef`` string."""

    def __call__(self, inp: torch.Tensor, mode: str = "decode") -> torch.Tensor:
        if mode == "encode":
            return self.module.encode(inp).unsqueeze(0)
        if mode != "decode":
            raise ValueError(f"mode must be 'encode' or 'decode', got {mode!r}")
        return self.module.decode(inp)

    forward = __call__

    def sample_audio(self, wav: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Codes [num_vq, T] of a mono 24 kHz wav."""
        if isinstance(wav, np.ndarray):
            wav = torch.from_numpy(wav)
        return self.module.encode(wav.to(self.module.coef.device))

    def __repr__(self) -> str:
        return b14.encode_to_string(self.module.coef.cpu().numpy().astype(np.float32).tobytes())
