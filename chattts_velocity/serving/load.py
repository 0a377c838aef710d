"""Loading a model for serving, the one way every launcher does it (one process, the engine process, a Ray
replica, the web demo): the device and engine dtype defaults, ``Chat.load``, a warm-up on CUDA so the first
clients do not pay for compilation and graph capture, long-lived objects kept out of the collector's scans, and
the audio rounds' pacing and thread."""

from __future__ import annotations

import logging
import sys
import threading
import time

import torch

from ..chat import Chat
from ..device import default_engine_dtype, resolve_device
from ..gc_freeze import freeze_long_lived
from ..params import InferCodeParams

logger = logging.getLogger(__name__)

AUDIO_THREAD_SWITCH_S = 0.0005
"""The GIL switch interval (``sys.setswitchinterval``) of a process whose audio rounds run on a thread of their
own: the engine's thread and the pump's hand the GIL to each other at every device wait and launch, and at
Python's 5 ms each handover can hold the other thread that long (later chunks then come late, and the engine's
windows start late); measured in docs/perf/serve.md. Never raised: a smaller interval set before is kept."""


def load_chat(load: dict, warmup: bool | None = None, audio_round_ms: float | None = None,
              threads: int | None = None, audio_thread: bool = False) -> Chat:
    """``Chat().load(**load)`` with the serving defaults: the device (``device.resolve_device``) and engine dtype
    (``device.default_engine_dtype``) where ``load`` leaves them unset; torch's intra-op ``threads``; ``warm_up``
    when ``warmup`` (default: on CUDA); then ``audio_round_ms`` as the pump's pacing and ``audio_thread`` as its
    thread where the decodes are CUDA graphs (``ServerConfig``), with this process's GIL switch interval at
    ``AUDIO_THREAD_SWITCH_S``."""
    if threads is not None:
        torch.set_num_threads(threads)
    device = resolve_device(load.get("device"))
    chat = Chat()
    chat.load(**{**load, "device": device, "engine_dtype": load.get("engine_dtype") or default_engine_dtype(device)})
    if warmup if warmup is not None else device.type == "cuda":
        warm_up(chat)
    if audio_round_ms is not None:
        chat.pipeline.pump.round_interval_s = audio_round_ms / 1000
    chat.pipeline.pump.thread = audio_thread and chat.audio.graphs is not None
    if audio_thread and not chat.pipeline.pump.thread:
        logger.info("audio decode rounds between the engine's steps on %s (a thread of their own only where the "
                    "decodes are CUDA graphs)", device)
    elif audio_thread:
        sys.setswitchinterval(min(sys.getswitchinterval(), AUDIO_THREAD_SWITCH_S))
        logger.info("audio decode rounds on a thread of their own (GIL switch interval %g ms)",
                    1e3 * sys.getswitchinterval())
    return chat


def warm_up(chat: Chat, streams: tuple[int, ...] = (1, 8, 37), tokens: int = 64) -> None:
    """Run short streams through the whole path (engine windows and CUDA graphs, the audio decoder's shapes,
    the allocator) so that the first clients do not pay for it. Each level starts its streams together, then
    again a few ms apart (prefills beside running decodes), with a speaker and a prompt that hits the prefix
    cache; 37 streams arrive as more prompts than one prefill CUDA graph takes, so several prefill steps come
    in a row, and decode in larger window batches (a fresh GPU then compiles no kernel while serving:
    ``chattts-velocity bench serve`` right after start-up; docs/perf/)."""
    pipeline = chat.pipeline
    speaker = chat.sample_random_speaker()
    # as requests come: a prompt long enough to share whole KV blocks (prefix-cache hits)
    texts = ["Warming up the speech server with one sentence as long as a short request would be."]

    def one(seed: int, delay: float) -> None:
        time.sleep(delay)
        p = InferCodeParams(spk_emb=speaker, max_new_token=tokens, min_new_token=tokens, manual_seed=seed,
                            show_tqdm=False)
        for _ in pipeline.stream_joined(texts, p, use_decoder=True):
            pass

    # the stream windows' decode graphs, every batch bucket (a capture at first use would stall a round)
    chat.audio.use_graphs(pipeline.stream_config.window_lengths(), capture=True)
    for n in streams:
        for gap in (0.0, 0.003):
            threads = [threading.Thread(target=one, args=(i, i * gap)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    # everything built so far lives as long as the server: a full collection (which holds the GIL) then walks
    # only what requests create
    freeze_long_lived()
