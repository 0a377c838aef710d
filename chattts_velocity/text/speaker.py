"""Speakers: the ``spk_emb`` / ``spk_smp`` string formats, random speakers, and the prompts built around them.

Both string formats are upstream's, byte for byte, so voices saved with ChatTTS load here and vice versa:

* ``spk_emb``: base16384 of raw-LZMA2 (preset 9 | EXTREME) of the float16 speaker vector;
* ``spk_smp`` (voice sample): base16384 of the shape as two little-endian uint16, then raw-LZMA2 of the
  audio codes [num_vq, T] as little-endian uint16.

Decoding checks everything, since these strings arrive from users.
"""

from __future__ import annotations

import functools
import lzma
import re
import struct
from importlib import resources

import numpy as np
import pybase16384 as b14
import torch
import torch.nn.functional as F

_LZMA = {"format": lzma.FORMAT_RAW, "filters": [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]}
# base16384: 4 characters in U+4E00..U+8DFF per 7 bytes, then a marker U+3D01..U+3D06 for a short tail.
# pybase16384 decodes any other character to garbage without complaint, hence the check.
_BASE16384 = re.compile(r"[\u4e00-\u8dff]*[\u3d01-\u3d06]?")
# Caps on what a string may inflate to: LZMA shrinks runs of zeros by orders of magnitude, so a short string could
# otherwise expand to gigabytes. Real speakers have a few hundred dims, voice samples a few thousand frames.
_MAX_SPEAKER_DIM = 1 << 16
_MAX_PROMPT_CODES = 1 << 22
_U16 = 1 << 16

_SPEAKER = "malformed speaker string"
_PROMPT = "malformed voice sample (spk_smp) string"


def _deflate(raw: bytes) -> bytes:
    return lzma.compress(raw, **_LZMA)


def _from_base16384(s: object, what: str) -> bytes:
    if not isinstance(s, str):
        raise ValueError(f"{what}: expected str, got {type(s).__name__}")
    s = s.strip()  # tolerate the newline a copy-paste picks up
    if not s or not _BASE16384.fullmatch(s):
        raise ValueError(f"{what}: not base16384 text")
    return b14.decode_from_string(s)


def _inflate(data: bytes, limit: int, what: str) -> bytes:
    """Raw-LZMA2 decompress ``data``, refusing more than ``limit`` bytes of output and trailing junk."""
    d = lzma.LZMADecompressor(**_LZMA)
    try:
        raw = d.decompress(data, max_length=limit + 1)
    except lzma.LZMAError as e:
        raise ValueError(f"{what}: not LZMA data ({e})") from None
    if len(raw) > limit:
        raise ValueError(f"{what}: decompresses to more than {limit} bytes")
    if not d.eof or d.unused_data:
        raise ValueError(f"{what}: compressed data is truncated or has trailing bytes")
    return raw


def encode_speaker(vec: torch.Tensor) -> str:
    """The ``spk_emb`` string of a 1-D speaker vector (stored as float16)."""
    if vec.dim() != 1 or not vec.is_floating_point():
        raise ValueError(f"speaker vector must be a 1-D float tensor, got {vec.dtype} of shape {tuple(vec.shape)}")
    half = vec.detach().to(device="cpu", dtype=torch.float16)
    if not torch.isfinite(half).all():
        raise ValueError("speaker vector has values that are not finite in float16")
    return b14.encode_to_string(_deflate(half.numpy().astype("<f2").tobytes()))


def decode_speaker(s: str, dim: int | None = None) -> torch.Tensor:
    """The float16 vector of a ``spk_emb`` string; ``dim`` if given is the required length."""
    raw = _inflate(_from_base16384(s, _SPEAKER), 2 * _MAX_SPEAKER_DIM, _SPEAKER)
    if not raw or len(raw) % 2:
        raise ValueError(f"{_SPEAKER}: {len(raw)} bytes is not a whole number of float16 values")
    vec = torch.from_numpy(np.frombuffer(raw, dtype="<f2").astype(np.float16))
    if dim is not None and vec.numel() != dim:
        raise ValueError(f"{_SPEAKER}: it holds {vec.numel()} values but this model's speakers have {dim}")
    if not torch.isfinite(vec).all():
        raise ValueError(f"{_SPEAKER}: it holds values that are not finite")
    return vec


def encode_prompt(codes: torch.Tensor) -> str:
    """The ``spk_smp`` string of audio codes [num_vq, T]."""
    if codes.dim() != 2 or codes.is_floating_point() or codes.is_complex():
        raise ValueError(f"voice sample must be integer codes [num_vq, T], got {codes.dtype} {tuple(codes.shape)}")
    if max(codes.shape) >= _U16 or (codes.numel() and (codes.min() < 0 or codes.max() >= _U16)):
        raise ValueError("voice sample codes and both dimensions must fit in uint16 (0..65535)")
    arr = codes.detach().cpu().numpy().astype("<u2")
    return b14.encode_to_string(struct.pack("<2H", *arr.shape) + _deflate(arr.tobytes()))


def decode_prompt(s: str, num_vq: int | None = None, num_codes: int | None = None) -> torch.Tensor:
    """The int32 audio codes [num_vq, T] of a ``spk_smp`` string, checked against the model when
    ``num_vq`` (codebooks) and ``num_codes`` (codes per codebook) are given."""
    data = _from_base16384(s, _PROMPT)
    if len(data) < 4:
        raise ValueError(f"{_PROMPT}: too short to hold its shape")
    rows, cols = struct.unpack("<2H", data[:4])
    if rows * cols == 0 or rows * cols > _MAX_PROMPT_CODES:
        raise ValueError(f"{_PROMPT}: shape {rows}x{cols} is empty or too large")
    if num_vq is not None and rows != num_vq:
        raise ValueError(f"{_PROMPT}: it has {rows} codebooks but this model has {num_vq}")
    raw = _inflate(data[4:], 2 * rows * cols, _PROMPT)
    if len(raw) != 2 * rows * cols:
        raise ValueError(f"{_PROMPT}: it holds {len(raw) // 2} codes, its shape {rows}x{cols} says {rows * cols}")
    codes = torch.from_numpy(np.frombuffer(raw, dtype="<u2").astype(np.int32)).view(rows, cols)
    if num_codes is not None and int(codes.max()) >= num_codes:
        raise ValueError(f"{_PROMPT}: code {int(codes.max())} is out of range for a {num_codes}-code model")
    return codes


def decorate_code_prompts(texts: list[str], prompt: str, txt_smp: str | None, has_spk_emb: bool) -> list[str]:
    """The audio-code pass inputs ``[Stts][spk_emb|empty_spk]{txt_smp}{prompt}{text}[Ptts]``, as upstream.

    Unlike upstream, ``texts`` is left untouched (upstream strips the speaker tags in the caller's list).
    """
    texts = [_strip_speaker_tags(t) for t in texts]
    speaker = "[spk_emb]" if has_spk_emb else "[empty_spk]"
    head = f"[Stts]{speaker}{txt_smp or ''}{prompt or ''}"
    return [f"{head}{t}[Ptts]" for t in texts]


def _strip_speaker_tags(text: str) -> str:
    # A user-typed [Stts]/[spk_emb] would inject a second speaker slot (2noise/ChatTTS#459); same removal order.
    for tag in ("[Stts]", "[spk_emb]", "[empty_spk]"):
        text = text.replace(tag, "")
    return text.strip()


def decorate_text_prompts(texts: list[str], prompt: str) -> list[str]:
    """The refine-text pass inputs ``[Sbreak]{text}[Pbreak]{prompt}``, as upstream; ``texts`` is not changed."""
    return [f"[Sbreak]{t}[Pbreak]{prompt}" for t in texts]


class SpeakerStats:
    """Per-dimension std and mean of the model's speaker vectors, for drawing random speakers."""

    def __init__(self, std: torch.Tensor, mean: torch.Tensor) -> None:
        if std.dim() != 1 or std.shape != mean.shape:
            raise ValueError(
                f"speaker std and mean must be 1-D of one length, got {tuple(std.shape)} and {tuple(mean.shape)}"
            )
        self.std = std.to(torch.float16)
        self.mean = mean.to(torch.float16)

    @property
    def dim(self) -> int:
        return self.std.numel()

    @classmethod
    def builtin_768(cls) -> SpeakerStats:
        """The statistics of the released 768-dim ChatTTS model (upstream's ``spk_stat``)."""
        text = resources.files("chattts_velocity").joinpath("res", "spk_stat_768.txt").read_text("utf-8")
        stat = torch.from_numpy(np.frombuffer(b14.decode_from_string(text.strip()), dtype="<f2").astype(np.float16))
        std, mean = stat.chunk(2)
        return cls(std, mean)

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """A random speaker vector (float16); with ``generator=None`` it draws from torch's global RNG exactly as
        upstream ``sample_random_speaker`` does, so one ``torch.manual_seed`` gives the same voice in both."""
        noise = torch.randn(self.dim, dtype=torch.float16, device=self.std.device, generator=generator)
        return noise.mul_(self.std).add_(self.mean)

    def sample_random(self) -> str:
        return encode_speaker(self.sample())


def speaker_vector(spk: str | torch.Tensor, dim: int) -> torch.Tensor:
    """The unit-length speaker vector that replaces the ``[spk_emb]`` token's embedding, computed as upstream:
    a string decodes to float16, a tensor keeps its own float dtype, then L2-normalised in that dtype. A
    string's vector is computed once (a server's voices come back with every request) and copied out."""
    if isinstance(spk, str):  # a copy without a torch op (each lets go of the GIL: see ``_string_speaker``)
        return torch.from_numpy(_string_speaker(spk, dim).numpy().copy())
    if not isinstance(spk, torch.Tensor):
        raise ValueError(f"speaker must be a spk_emb string or a tensor, got {type(spk).__name__}")
    if spk.shape != (dim,) or not spk.is_floating_point():
        raise ValueError(f"speaker vector must be a 1-D float tensor of {dim} values, got {tuple(spk.shape)}")
    if not torch.isfinite(spk).all():
        raise ValueError("speaker vector has values that are not finite")
    return _unit(spk, "speaker vector")


@functools.lru_cache(maxsize=256)
def _string_speaker(spk: str, dim: int) -> torch.Tensor:
    """``speaker_vector`` of a string, kept (errors are not: a bad string raises every time). Each torch call
    lets go of the GIL and waits to take it back, so under a busy server the dozen or so calls of this decode
    cost a request more than the work. This cache, the prompt check on Python lists
    (``engine.validation.check_prompt``) and the numpy copies cut a request's preparation beside a thread busy
    in Python many times over (docs/perf/)."""
    return _unit(decode_speaker(spk, dim), _SPEAKER)


def _unit(vec: torch.Tensor, what: str) -> torch.Tensor:
    unit = F.normalize(vec, p=2.0, dim=0, eps=1e-12)
    if not torch.isfinite(unit).all() or not unit.any():  # 0 / 0: no direction to normalise
        raise ValueError(f"{what}: it is all zeros (or too small to normalise in {vec.dtype}), which is no "
                         "speaker; use one from Chat.sample_random_speaker()")
    return unit


@torch.inference_mode()
def apply_speaker(emb: torch.Tensor, input_ids: torch.Tensor, spk_emb_id: int, vec: torch.Tensor) -> torch.Tensor:
    """Overwrite, in place, the embeddings [B, T, H] at the ``[spk_emb]`` positions (first codebook of
    ``input_ids`` [B, T, num_vq]) with ``vec`` cast to ``emb``'s dtype, as upstream's float16-into-float32
    ``torch.where`` does. Returns ``emb``."""
    if emb.dim() != 3 or input_ids.dim() != 3 or input_ids.shape[:2] != emb.shape[:2] or vec.shape != emb.shape[-1:]:
        raise ValueError(
            f"shape mismatch: emb {tuple(emb.shape)}, input_ids {tuple(input_ids.shape)}, vec {tuple(vec.shape)}"
        )
    emb[input_ids[..., 0] == spk_emb_id] = vec.to(device=emb.device, dtype=emb.dtype)
    return emb
