"""The ChatTTS GPT for the reference path: transformers' ``LlamaModel`` fed with ChatTTS embeddings.

This is what upstream runs (one batch, a per-step Python loop over a Hugging Face KV cache); it is the baseline
every benchmark compares against and the ``use_velocity=False`` path of ``Chat.infer``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import GPTConfig
from .embed import Embed


class ChatGPT(nn.Module):
    """Llama core + ChatTTS embeddings/heads. ``llama`` has no token embedding: inputs are embeddings."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        from transformers import LlamaModel

        self.config = config
        self.llama = LlamaModel(config.to_llama_config())
        del self.llama.embed_tokens
        self.embed = Embed(config.hidden_size, config.num_audio_tokens, config.num_text_tokens, config.num_vq)

    def prompt_embeddings(
        self, input_ids: torch.Tensor, text_mask: torch.Tensor, spk_id: int | None, spk_vec: torch.Tensor | None
    ) -> torch.Tensor:
        """[B, T, num_vq] ids -> [B, T, H], the speaker vector written at ``[spk_emb]`` positions."""
        from ..text import apply_speaker

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
