"""The ChatTTS text tokenizer: text to the ``[B, T, num_vq]`` id tensors the GPT reads, and ids back to text."""

from __future__ import annotations

import os

import numpy as np
import torch
from transformers import BertTokenizerFast

# The Rust tokenizer's thread pool deadlocks in forked workers and warns about it; one text at a time is fast.
# Read when the pool is first used, so setting it after the import is in time.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")


class Tokenizer:
    """Wraps the ``BertTokenizerFast`` in ``path`` (a folder holding ``tokenizer.json`` or ``vocab.txt``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
            raise ValueError(
                f"no tokenizer in {path!r}: expected a folder with one of {', '.join(_TOKENIZER_FILES)} "
                "(the checkpoint's asset/tokenizer folder)"
            )
        self._tokenizer = BertTokenizerFast.from_pretrained(path)
        backend = self._tokenizer.backend_tokenizer
        # the Rust tokenizer itself where it neither truncates nor pads (what the Hugging Face call makes it do):
        # the same ids without the wrapper's Python, which a server's front pays for every sentence
        self._backend = backend if backend.truncation is None and backend.padding is None else None
        self.len = len(self._tokenizer)
        self.spk_emb_ids = self._tokenizer.convert_tokens_to_ids("[spk_emb]")
        self.break_0_ids = self._tokenizer.convert_tokens_to_ids("[break_0]")
        self.eos_token = self._tokenizer.convert_tokens_to_ids("[Ebreak]")

    def ids(self, text: str) -> list[int]:
        """Token ids of ``text``, without [CLS]/[SEP]."""
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self._tokenizer(text, add_special_tokens=False)["input_ids"]

    def count(self, text: str) -> int:
        return len(self.ids(text))

    def encode(
        self,
        text: list[str],
        num_vq: int,
        prompt: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded ``input_ids`` [B, T, num_vq] (int64; a text id repeated over the codebooks),
        ``attention_mask`` [B, T] (int64) and ``text_mask`` [B, T] (bool).

        A voice-sample ``prompt`` of audio codes [num_vq, P] fills the last P positions of every row, where
        ``text_mask`` is False; upstream-identical layout.
        """
        prompt_len = 0
        if prompt is not None:
            if prompt.dim() != 2 or prompt.size(0) != num_vq:
                raise ValueError(
                    f"prompt must be audio codes of shape [num_vq={num_vq}, length], got {tuple(prompt.shape)}"
                )
            prompt_len = prompt.size(1)
        # built in numpy and wrapped once: each torch op lets go of the GIL and must take it back, which beside
        # a busy engine thread costs up to a switch interval an op (docs/perf/)
        rows = [self.ids(t) for t in text]
        width = max((len(r) for r in rows), default=0) + prompt_len
        ids = np.zeros((len(rows), width, num_vq), dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        text_end = width - prompt_len
        for i, row in enumerate(rows):
            ids[i, text_end - len(row) : text_end] = np.asarray(row, dtype=np.int64)[:, None]
            mask[i, text_end - len(row) :] = 1
        text_mask = mask.astype(bool)
        if prompt_len:
            ids[:, text_end:] = prompt.detach().cpu().numpy().T
            text_mask[:, text_end:] = False
        out = torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(text_mask)
        if torch.device(device).type == "cpu":
            return out
        return tuple(t.to(device) for t in out)

    def decode(self, sequences: list[list[int]] | list[torch.Tensor], skip_special_tokens: bool = False,
               **kwargs) -> list[str]:
        """Text of each id sequence, special tokens kept by default (they carry the refiner's [uv_break] & co.);
        ``kwargs`` go to the Hugging Face tokenizer's ``batch_decode``."""
        return self._tokenizer.batch_decode(sequences, skip_special_tokens=skip_special_tokens, **kwargs)


def check_context(length: int, limit: int) -> None:
    """Raise if a prompt of ``length`` tokens leaves no room to generate in a context of ``limit``."""
    if length >= limit:
        raise ValueError(
            f"text is longer than the model's context: the prompt (text, tags and any voice-sample transcript "
            f"txt_smp) has {length} tokens, the model holds {limit}; shorten the text or txt_smp, or let infer "
            "split it (split_text=True)"
        )
