"""``Sequence``: the decoding state of one request (ChatTTS samples one sequence per request: no beam search, no
n > 1), with ``Prompt`` (a request's input) and ``RequestOutput`` (what a step reports of it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from .sampling_params import Mode, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    EOS = "eos"
    """A codebook (or the text head) sampled EOS; EOS is not part of the output."""
    LENGTH = "length"
    """``max_new_tokens`` was reached."""
    CAPACITY = "capacity"
    """Cut short of ``max_new_tokens``: the model's context or the whole KV cache holds no longer sequence."""
    ABORT = "abort"
    """``abort_request`` was called."""
    ERROR = "error"
    """A step that computed this request failed (``RequestOutput.error`` says why); the others went on."""


@dataclass(frozen=True)
class Prompt:
    """One request's input: token ids over the codebooks, which positions are text, and the speaker vector.

    ``ids`` [T, num_vq] int64 (a text id is repeated over the codebooks, as upstream's tokenizer does);
    ``text_mask`` [T] bool (False = audio position, embedded as the sum of its codes);
    ``speaker`` [H] float, written at the ``[spk_emb]`` positions, or None."""

    ids: torch.Tensor
    text_mask: torch.Tensor
    speaker: torch.Tensor | None = None


Token = tuple[int, ...]
"""One position: ``num_vq`` ids (a text token repeats its id)."""


class TokenBuffer:
    """A sequence's tokens, one row of ``width`` ids a position, in one growable int64 array: a decode window's
    rows are appended at once (``extend``) and read back in bulk as array views (``rows``), so the engine's
    thread does no Python work per token of a window; an index, a slice or iteration reads ``Token`` tuples.
    Rows once written do not change (``rows``' views stay valid while the buffer grows)."""

    __slots__ = ("_buf", "_n")

    def __init__(self, rows):
        buf = np.array(rows, dtype=np.int64)  # (a copy: the caller's rows stay theirs)
        if buf.ndim != 2 or buf.shape[0] == 0:
            raise ValueError(f"tokens must be a non-empty [T, width] grid of ids, got shape {buf.shape}")
        self._buf, self._n = buf, buf.shape[0]

    @property
    def width(self) -> int:
        return self._buf.shape[1]

    def __len__(self) -> int:
        return self._n

    def rows(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Positions [start, stop) as a read-only view [n, width] (slice bounds as for a list)."""
        lo, hi, _ = slice(start, stop).indices(self._n)
        view = self._buf[lo:max(lo, hi)]
        view.setflags(write=False)
        return view

    def extend(self, rows) -> None:
        """Append [k, width] rows (an array, or ``Token``s)."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return
        if rows.ndim != 2 or rows.shape[1] != self.width:
            raise ValueError(f"rows must be [k, {self.width}], got {rows.shape}")
        n, k = self._n, rows.shape[0]
        if n + k > self._buf.shape[0]:  # room for many more windows: amortized, like a list
            grown = np.empty((max(2 * self._buf.shape[0], n + k, 64), self.width), dtype=np.int64)
            grown[:n] = self._buf[:n]
            self._buf = grown
        self._buf[n : n + k] = rows
        self._n = n + k

    def __getitem__(self, key):
        if isinstance(key, slice):
            return list(map(tuple, self._buf[: self._n][key].tolist()))
        return tuple(self._buf[: self._n][key].tolist())

    def __setitem__(self, index: int, token: Token) -> None:
        self._buf[: self._n][index] = token


class Sequence:
    """Tokens (prompt + generated), KV bookkeeping and outputs of one request."""

    def __init__(self, seq_id: int, request_id: str, tokens, is_text: list[bool],
                 speaker: torch.Tensor | None, speaker_key: bytes, params: SamplingParams, seed: int,
                 max_tokens: int):
        self.seq_id = seq_id
        self.request_id = request_id
        self.tokens = tokens if isinstance(tokens, TokenBuffer) else TokenBuffer(tokens)
        """Prompt and generated tokens (``TokenBuffer``; built from [T, num_vq] ids or ``Token``s)."""
        self.is_text = is_text
        self.prompt_len = len(tokens)
        self.speaker = speaker
        self.speaker_key = speaker_key
        """Digest of the speaker vector: part of every prefix-cache key of this sequence."""
        self.params = params
        self.seed = seed
        self.max_tokens = max_tokens
        """Total tokens (prompt + generated) this sequence may reach: model context and KV capacity."""
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        """Tokens whose K/V are in the cache (prefix-cache hits included)."""
        self.block_table: list[int] = []
        self.num_cached_blocks = 0
        """Leading blocks of ``block_table`` already offered to the prefix cache."""
        self.block_hashes: list[bytes] = []
        """Content hashes of the full blocks of ``tokens`` computed so far (a chain; see BlockSpaceManager)."""
        self.hidden_chunks: list[torch.Tensor] = []
        """Final-norm hidden states [n, H] that produced the generated tokens, in order, one chunk per step."""
        self.num_reported = 0
        """Generated tokens already returned by ``LLMEngine.step``."""

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def text_mode(self) -> bool:
        return self.params.mode is Mode.TEXT

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def extend(self, tokens) -> None:
        """Add several generated tokens, [k, num_vq] ids or ``Token``s (their hidden states are kept by the
        caller)."""
        self.tokens.extend(tokens)
        self.is_text.extend([self.text_mode] * (len(self.tokens) - len(self.is_text)))

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def output_ids(self, start: int = 0) -> torch.Tensor:
        """Generated ids from ``start``: [n, num_vq] (code mode) or [n] (text mode), int64."""
        ids = torch.from_numpy(self.tokens.rows(self.prompt_len + start).copy())
        return ids[:, 0] if self.text_mode else ids

    def output_hidden(self, hidden_size: int, start: int = 0) -> torch.Tensor | None:
        """Hidden states [n, H] of the generated tokens from ``start`` (None when not requested)."""
        if not self.params.return_hidden_states:
            return None
        need, parts = self.num_generated - start, []
        for chunk in reversed(self.hidden_chunks):  # the newest chunks hold what was not reported yet
            if need <= 0:
                break
            n = chunk.shape[0]
            parts.append(chunk if need >= n else chunk[-need:])  # (a view costs a torch call)
            need -= n
        if not parts:  # nothing new: an empty tensor like the chunks (same device and dtype)
            like = self.hidden_chunks[-1] if self.hidden_chunks else None
            if like is None:
                return torch.empty(0, hidden_size)
            return like.new_empty(0, hidden_size)
        return parts[0] if len(parts) == 1 else torch.cat(parts[::-1])


@dataclass
class RequestOutput:
    """What ``LLMEngine.step`` reports for one request that advanced (or finished) in that step.

    ``new_token_ids``/``new_hidden_states`` hold the tokens generated since the last report ([n, num_vq] or [n]
    ids; [n, H] hidden states, None unless requested). When ``finished``, ``token_ids``/``hidden_states``
    hold the whole output (what was generated before an abort or a failure included)."""

    request_id: str
    new_token_ids: torch.Tensor
    new_hidden_states: torch.Tensor | None
    num_generated: int
    finished: bool
    finish_reason: FinishReason | None = None
    token_ids: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    error: Exception | None = None
    """Why the request failed (finish reason ``error``)."""
