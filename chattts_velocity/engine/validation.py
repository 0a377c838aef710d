"""A request's checks, made once on the caller's thread before it reaches the engine: its prompt against the
model, its ``SamplingParams`` against what the sampler represents, its length against the KV cache. Pure
checks: a server's front runs them without the engine."""

from __future__ import annotations

import numpy as np
import torch

from .sampling_params import Mode, SamplingParams
from .sequence import Prompt


def validate_request(cfg, kv_capacity: int, prompt: Prompt, params: SamplingParams
                     ) -> tuple[np.ndarray, list[bool]]:
    """Raise ``ValueError`` saying what to fix if the request can never be served by an engine over a model of
    config ``cfg`` with ``kv_capacity`` tokens of KV cache; else its tokens (a pure check: a server's front
    runs it without the engine; ``check_prompt``'s)."""
    params.validate(cfg.num_vq, cfg.num_text_tokens if params.mode is Mode.TEXT else cfg.num_audio_tokens)
    tokens, is_text = check_prompt(cfg, prompt)
    context = cfg.max_position_embeddings
    if len(tokens) >= min(context, kv_capacity):
        limit = "the model's context" if context <= kv_capacity else "the KV cache"
        raise ValueError(
            f"prompt of {len(tokens)} tokens leaves no room to generate: {limit} holds "
            f"{min(context, kv_capacity)} tokens; shorten the prompt"
            + ("" if context <= kv_capacity else " or give the engine more KV cache")
        )
    return tokens, is_text


def check_prompt(cfg, prompt: Prompt) -> tuple[np.ndarray, list[bool]]:
    """Raise ``ValueError`` saying what to fix if ``prompt`` does not fit a model of config ``cfg``; else its
    tokens ([T, num_vq] int64 ids, maybe a view of ``prompt.ids``: ``Sequence`` copies them) and which
    positions are text."""
    ids, mask = prompt.ids, prompt.text_mask
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.size(1) != cfg.num_vq or ids.is_floating_point():
        raise ValueError(f"prompt.ids must be an integer tensor [T, num_vq={cfg.num_vq}], got "
                         f"{getattr(ids, 'shape', type(ids).__name__)}")
    if ids.size(0) == 0:
        raise ValueError("prompt is empty: give at least one token")
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape[:1] or mask.dtype != torch.bool:
        raise ValueError(f"prompt.text_mask must be a bool tensor [{ids.size(0)}], got "
                         f"{getattr(mask, 'shape', type(mask).__name__)}")
    # checked in numpy (a tensor numpy cannot read, as on a GPU, through one list): each torch call would let
    # go of the GIL and wait to take it back, which a busy server's request threads pay dearly (``text.speaker``)
    host_ids, host_mask = (_host_array(t) for t in (ids, mask))
    host_ids = np.asarray(ids.tolist()) if host_ids is None else host_ids
    host_mask = np.asarray(mask.tolist(), dtype=bool) if host_mask is None else host_mask
    for name, part, limit in (("text", host_ids[host_mask], cfg.num_text_tokens),
                              ("audio", host_ids[~host_mask], cfg.num_audio_tokens)):
        if part.size and (part.min() < 0 or part.max() >= limit):
            raise ValueError(f"prompt has {name} ids outside [0, {limit})")
    is_text = host_mask.tolist()
    spk = prompt.speaker
    if spk is not None and (not isinstance(spk, torch.Tensor) or spk.shape != (cfg.hidden_size,)
                            or not spk.is_floating_point() or not _finite(spk)):
        raise ValueError(f"prompt.speaker must be None or a finite float tensor [{cfg.hidden_size}]")
    return host_ids.astype(np.int64, copy=False), is_text


# A request's preparation runs on a server's worker threads; every torch op there lets go of the GIL and must
# take it back from a busy engine thread (up to a switch interval each: docs/perf/). A CPU
# vector of a dtype numpy has goes through numpy instead, which keeps the GIL.
def _host_array(vec: torch.Tensor) -> np.ndarray | None:
    if vec.device.type != "cpu" or vec.dtype == torch.bfloat16 or vec.requires_grad:
        return None
    return vec.numpy()


def _finite(vec: torch.Tensor) -> bool:
    host = _host_array(vec)
    return bool(np.isfinite(host).all()) if host is not None else bool(torch.isfinite(vec).all())


def float32_host(vec: torch.Tensor) -> torch.Tensor:
    """A float32 CPU copy of ``vec`` (a speaker vector), through numpy where it can."""
    host = _host_array(vec)
    if host is not None:
        return torch.from_numpy(host.astype(np.float32))  # a copy, as .to() of another dtype makes
    return vec.detach().to(torch.float32).cpu()
