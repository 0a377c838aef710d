"""The ChatTTS GPT for the reference path: transformers' ``LlamaModel`` fed with ChatTTS embeddings.

This is what upstream runs (one batch, a per-step Python loop over a Hugging Face KV cache); it is the baseline
every benchmark compares against and the ``use_velocity=False`` path of ``Chat.infer``. The velocity engine
builds its own copy of the Llama weights; where that copy cannot share them (another dtype or device),
``release_llama`` lets the Llama's go and the reference path reads them again on its first use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn

from ..text import apply_speaker
from .embed import Embed
from .gpt_config import GPTConfig


class ChatGPT(nn.Module):
    """Llama core + ChatTTS embeddings/heads. ``llama`` has no token embedding: inputs are embeddings."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        from transformers import LlamaModel

        self.config = config
        self.llama = LlamaModel(config.to_llama_config())
        del self.llama.embed_tokens
        self.embed = Embed(config.hidden_size, config.num_audio_tokens, config.num_text_tokens, config.num_vq)
        self.llama_source: Callable[[], dict[str, torch.Tensor]] | None = None
        """Reads the Llama's weights again (its state dict, any device and dtype); the loader sets it."""
        self._llama_lock = threading.Lock()
        self._llama_released = False
        self._llama_shapes: dict[str, torch.Size] = {}

    @property
    def llama_released(self) -> bool:
        return self._llama_released

    def release_llama(self) -> int:
        """Free the Llama's weights until ``ensure_llama`` (the reference path calls it) reads them again from
        ``llama_source``; returns the bytes let go (0 without a source: nothing could bring them back)."""
        with self._llama_lock:
            if self.llama_source is None or self._llama_released:
                return 0
            freed = 0
            self._llama_shapes = {}
            for name, p in self.llama.named_parameters():
                freed += p.numel() * p.element_size()
                self._llama_shapes[name] = p.shape
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._llama_released = True
            return freed

    def ensure_llama(self) -> None:
        """The Llama's weights in place again after ``release_llama`` (a no-op otherwise), in their dtype and on
        their device. Thread-safe: concurrent callers read the source once."""
        if not self._llama_released:
            return
        with self._llama_lock:
            if not self._llama_released:
                return
            state = self.llama_source()
            params = dict(self.llama.named_parameters())
            missing = sorted(set(params) - set(state))
            if missing:
                raise RuntimeError(f"re-reading the reference model's weights: {len(missing)} missing, e.g. "
                                   f"{missing[0]!r} (did the checkpoint change since it was loaded?)")
            for name in params:
                value, shape = state[name], self._llama_shapes[name]
                if value.shape != shape:
                    raise RuntimeError(f"re-reading the reference model's weights: {name} has shape "
                                       f"{tuple(value.shape)}, not {tuple(shape)}")
            # fresh (aligned) tensors, as the first load copied into: a tensor mapped from the safetensors file
            # may sit at any offset, which changes the CPU GEMMs' last bits; ordinary tensors, also when the
            # reference path runs in inference mode
            with torch.inference_mode(False):
                for name, p in params.items():
                    p.data = state[name].to(device=p.device, dtype=p.dtype, copy=True)
            self._llama_released = False

    def prompt_embeddings(
        self, input_ids: torch.Tensor, text_mask: torch.Tensor, spk_id: int | None, spk_vec: torch.Tensor | None
    ) -> torch.Tensor:
        """[B, T, num_vq] ids -> [B, T, H], the speaker vector written at ``[spk_emb]`` positions."""
        emb = self.embed(input_ids, text_mask)
        if spk_vec is not None:
            apply_speaker(emb, input_ids, spk_id, spk_vec)
        return emb

    def hidden_states(
        self,
        emb: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache=None,
        cache_position: torch.Tensor | None = None,
    ):
        """Final-norm hidden states [B, T, H] (float32) and the updated KV cache."""
        self.ensure_llama()
        out = self.llama(
            inputs_embeds=emb.to(self.llama.dtype),
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            cache_position=cache_position,
            use_cache=True,
        )
        return out.last_hidden_state.float(), out.past_key_values

    @torch.inference_mode()
    def teacher_forced_logits(
        self,
        input_ids: torch.Tensor,
        text_mask: torch.Tensor,
        attention_mask: torch.Tensor,
        spk_id: int | None = None,
        spk_vec: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of every position in one pass: code [B, T, V_audio, num_vq] and text [B, T, V_text]."""
        emb = self.prompt_embeddings(input_ids, text_mask, spk_id, spk_vec)
        hidden, _ = self.hidden_states(emb, attention_mask, position_ids_from_mask(attention_mask))
        return self.embed.code_logits(hidden), self.embed.text_logits(hidden)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Left-padding aware positions: cumsum of the mask minus one, padding positions set to 1 (as upstream)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask.eq(0), 1)
