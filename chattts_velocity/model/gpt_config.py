"""``GPTConfig``: the model's sizes, every one read from the checkpoint itself, so any consistent ChatTTS-layout
checkpoint loads (the real 768-wide model, tiny random test models, anything in between)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class GPTConfig:
    """The Llama core and its ChatTTS heads."""

    hidden_size: int = 768
    """Model width (also the speaker-vector size)."""
    intermediate_size: int = 3072
    """MLP width."""
    num_attention_heads: int = 12
    """Query heads."""
    num_key_value_heads: int = 12
    """Key/value heads (ChatTTS uses no GQA)."""
    num_hidden_layers: int = 20
    """Decoder layers."""
    max_position_embeddings: int = 4096
    """Context length: prompt plus generated tokens."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary base."""
    num_audio_tokens: int = 626
    """Codes per codebook; the last one is EOS."""
    num_text_tokens: int = 21178
    """Text vocabulary (tokenizer size)."""
    num_vq: int = 4
    """Parallel audio codebooks."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "num_hidden_layers", "max_position_embeddings", "num_audio_tokens", "num_text_tokens", "num_vq"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPT config: {name} must be a positive int, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ValueError(f"GPT config: {name} must be a positive number, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"GPT config: hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("GPT config: num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def eos_code(self) -> int:
        """The audio EOS code (last code of each codebook)."""
        return self.num_audio_tokens - 1

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> GPTConfig:
        """Read ``asset/gpt/config.json`` (a Hugging Face LlamaConfig with ChatTTS extras)."""
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"GPT config not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if raw.get("model_type", "llama") != "llama":
            raise ValueError(f"{path}: model_type must be 'llama', got {raw.get('model_type')!r}")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
                   if k not in raw]
        if missing:
            raise ValueError(f"{path}: missing keys {missing}")
        fields = {k: raw[k] for k in cls.__dataclass_fields__ if raw.get(k) is not None}
        fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
        try:
            return cls(**fields)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def to_llama_config(self):
        """The transformers ``LlamaConfig`` of the core (no token embedding: inputs are embeddings)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            num_hidden_layers=self.num_hidden_layers,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            vocab_size=1,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
            attention_bias=False,
            mlp_bias=False,
            use_cache=True,
            attn_implementation="sdpa",
        )

    def to_json_dict(self) -> dict:
        """``config.json`` content in the upstream layout."""
        out = {"architectures": ["LlamaModel"], "model_type": "llama", "hidden_act": "silu",
               "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
               "spk_KL": False, "spk_emb_dim": 192, "use_cache": False, "vocab_size": 32000,
               "rope_scaling": None, "torch_dtype": "float32"}
        out.update({k: getattr(self, k) for k in self.__dataclass_fields__})
        return out


FULL_GPT = GPTConfig()
