"""``EngineConfig``: the engine's one configuration object, validated when built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.float32}
ENGINE_DTYPES = tuple(_DTYPES)
"""The engine dtypes (``EngineConfig.dtype``)."""
CPU_WEIGHTS = {"float16": "float16", "bfloat16": "bfloat16", "int8": "int8"}
"""Engine dtype -> the ``kernels.linear.CpuWeight`` format of the Llama core's matrices and the code and text heads
on the CPU; the activations, norms, embeddings and KV cache stay float32 there (``core_format``)."""
CPU_ONLY = ("int8",)
"""Engine dtypes that only the CPU runs."""


@dataclass(frozen=True)
class EngineConfig:
    """KV cache, batching and numeric settings of the velocity engine."""

    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: int | None = None
    """KV blocks to allocate; None sizes the cache from ``kv_cache_gib``."""
    kv_cache_gib: float | None = None
    """KV cache memory; None: ``model_runner.GPU_KV_FRACTION`` of the free GPU memory on CUDA,
    ``model_runner.CPU_KV_GIB`` on CPU (never more than ``max_num_seqs`` full contexts need)."""
    max_num_seqs: int = 64
    """Sequences decoded together (running at once)."""
    max_num_batched_tokens: int | None = None
    """Tokens computed per step; longer prompts are prefilled in chunks of at most this many. None: 8,192 on
    CUDA (where a step of prompts runs alone, up to 256 of them), 2,048 on the CPU (where prompts share a step
    with the running decodes, which wait for it)."""
    enable_prefix_caching: bool = True
    """Share the KV of equal prompt prefixes (same ids, text/audio layout and speaker) between requests."""
    watermark: float = 0.01
    """Fraction of blocks kept free when admitting requests, so running ones can grow without preemption."""
    dtype: str = "float32"
    """The Llama core's dtype (logits are always float32). On CUDA: float32, float16 or bfloat16 activations,
    weights and KV cache. On the CPU: float32 everything, or float32 activations and KV cache with the matrices
    (the code and text heads too) stored as float16, bfloat16 or int8 (a scale per output row), which a CPU
    step, bound by reading the weights, streams fewer bytes of (``CPU_WEIGHTS``; `chattts-velocity
    bench agreement` measures how closely each follows float32, docs/perf/cpu.md). On the CPU float16's and int8's
    kernels compute each row alone, so a request gets the same bits in any batch; float32's (MKL) and
    bfloat16's (oneDNN) GEMMs round differently by batch size at the full model's sizes."""
    num_decode_steps: int = 32
    """Decode steps per scheduler call when the batch is all audio decodes (the device updates the inputs
    between them); 1 schedules every step. No window runs past every sequence's length limit, but a sequence
    that ends by EOS may compute up to this many unused steps, and a new request waits for the running window
    (two with ``pipeline_decode``)."""
    max_decode_steps: int | None = None
    """Most steps a full decode window grows to while the host's work between two pipelined windows (reading
    one, its reports, the audio rounds of a streaming load) outlasts a window on the device: with windows of
    ``num_decode_steps`` the device would idle between them (hundreds of in-process streams: docs/perf/). The
    engine measures both for every window queued behind another, and where the host's part is clearly the
    longer (``scheduler.GROW_AT``) the next full windows grow to cover it (``Scheduler.fit_window``); they
    shrink back, never below ``num_decode_steps``, once the host keeps up. Equal to ``num_decode_steps``: windows
    never grow; None: twice ``num_decode_steps``. CUDA only (pipelined windows)."""
    window_budget_ms: float | None = 300.0
    """Longest a full decode window should run, at the step time of the latest decode window: fewer than
    ``num_decode_steps`` steps where steps are slow (the CPU's), never fewer than two. A stream's audio comes
    at window ends, so a window is the gap its listener must ride out (``audio.deadlines``): with windows of
    many slow steps, streamed audio came in bursts and a stream's first audio was held until it outlasted one
    (docs/perf/cpu.md); a request that arrives also waits for the running window. A GPU's full windows mostly
    fit. None: always ``num_decode_steps``."""
    max_window_tokens: int | None = None
    """Most tokens one decode window computes (steps x sequences) while requests arrive (one waits, or came
    since the last window was scheduled): a larger batch runs shorter windows, never fewer than
    ``scheduler.MIN_CAPPED_STEPS`` steps nor more than ``num_decode_steps``. A request that arrives while a
    window runs waits for it, and under a server's load (hundreds of sequences) a full window is a long wait;
    capping the tokens caps that wait. A window no arrival waits for runs ``num_decode_steps``. None: always
    ``num_decode_steps`` (best throughput)."""
    window_stops: tuple[int, ...] = (16, 24)
    """Generated-token counts where a young audio stream's window ends: a batch whose youngest audio sequence
    is short of the last stop runs a window that ends at that sequence's next stop, so its first audio
    (``StreamConfig.first_chunk + lookahead`` tokens, 16 by default) does not wait for a full window. The
    second stop, at the second chunk (24 with ``StreamConfig``'s defaults), keeps that chunk from waiting for
    a full window when a full window would outlast the first chunk's audio (``window_stop_budget_ms``).
    Increasing ints >= 1; () disables."""
    window_stop_budget_ms: float | None = 50.0
    """A stop after the first applies only while a full decode window (``num_decode_steps``, or fewer within
    ``window_budget_ms``, at the step time of the latest decode window) would take longer than this: then a young
    stream's next chunk would come after its first chunk has played (8 tokens are 171 ms of audio), so the window
    ends at the stop. Below it the window runs whole, sparing a window end (a report and an audio round) per young
    stream, which under a steady flow of arrivals costs throughput (docs/perf/stream.md). The windows' ends then
    follow the measured step time, so two runs of one workload near the budget can end a window at different steps;
    a sequence that finishes inside it then leaves the batch at another step, and on CUDA in float16, whose GEMMs
    round by the batch's row count, the others' later tokens can differ. None: every stop always applies, and the
    schedule depends on the workload alone."""
    prefill_first: bool | None = None
    """A step that has prompts to compute (waiting requests, a long prompt's next chunk) computes prompts only,
    and the running sequences decode in the next step (a window). Mixed into one step, a few new prompts beside
    hundreds of decodes make a step too large for the prefill CUDA graphs, so it runs eagerly and many times
    slower (`chattts-velocity bench serve`; docs/perf/). On CUDA such a step admits no more sequences and tokens
    than the largest prefill graph takes. None: on CUDA only."""
    pipeline_decode: bool | None = None
    """Queue the next decode window before reading the current one's tokens while the batch cannot change, so
    host work overlaps the device's. None: on CUDA only (on CPU the window runs inside the launch, so it would
    only delay each report by a window)."""
    open_window_max_seqs: int = 16
    """Where requests arrive while the engine runs (``AsyncLLMEngine``), a full decode window of at most this
    many sequences runs open: queued ``window_lookahead`` steps ahead of the device rather than all at once, and
    a request that arrives during it ends it there, so its prompt step waits for a few steps, not for the rest
    of the window. A window that brings a sequence to its first audio runs whole, and so does a larger batch:
    there, ending a window at each arrival (a prompt step and a first window each, where a whole window's end
    takes several arrivals' prompts in one step) costs more than it saves. 0: every window runs whole."""
    window_lookahead: int = 4
    """Steps an open window keeps queued ahead of the device (see ``open_window_max_seqs``)."""
    enforce_eager: bool = False
    """Never use CUDA graphs (they are used on CUDA for the multi-step decode and the padded prefill steps
    otherwise)."""

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("num_decode_steps", self.num_decode_steps)
        if self.max_decode_steps is not None:
            _positive("max_decode_steps", self.max_decode_steps)
            if self.max_decode_steps < self.num_decode_steps:
                raise ValueError(f"max_decode_steps must be >= num_decode_steps ({self.num_decode_steps}) or None, "
                                 f"got {self.max_decode_steps!r}")
        if self.max_window_tokens is not None:
            _positive("max_window_tokens", self.max_window_tokens)
        _positive("window_lookahead", self.window_lookahead)
        if not isinstance(self.open_window_max_seqs, int) or self.open_window_max_seqs < 0:
            raise ValueError(f"open_window_max_seqs must be an int >= 0, got {self.open_window_max_seqs!r}")
        stops = self.window_stops
        if (not isinstance(stops, tuple) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                                    for n in stops) or list(stops) != sorted(set(stops))):
            raise ValueError(f"window_stops must be a tuple of increasing ints >= 1, got {stops!r}")
        _budget("window_stop_budget_ms", self.window_stop_budget_ms, zero_ok=True)
        _budget("window_budget_ms", self.window_budget_ms, zero_ok=False)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_gib is not None and not (isinstance(self.kv_cache_gib, (int, float)) and self.kv_cache_gib > 0):
            raise ValueError(f"kv_cache_gib must be a number > 0 or None, got {self.kv_cache_gib!r}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")

    @property
    def decode_steps_cap(self) -> int:
        """``max_decode_steps``, or twice ``num_decode_steps`` where it is None."""
        return 2 * self.num_decode_steps if self.max_decode_steps is None else self.max_decode_steps

    @property
    def torch_dtype(self) -> torch.dtype:
        """The core's dtype on CUDA (``core_format`` gives it on any device)."""
        return _DTYPES[self.dtype]

    def core_format(self, device: torch.device) -> tuple[torch.dtype, str | None]:
        """The Llama core's activation and KV-cache dtype on ``device``, and the ``CpuWeight`` format of its
        matrices (None: stored in that dtype). ``ValueError`` for a CPU-only dtype elsewhere."""
        if device.type == "cpu":
            weights = CPU_WEIGHTS.get(self.dtype)
            return (torch.float32 if weights else self.torch_dtype), weights
        if self.dtype in CPU_ONLY:
            raise ValueError(f"engine dtype {self.dtype!r} runs on the CPU only; on {device} use float16, bfloat16 "
                             "or float32")
        return self.torch_dtype, None


def _budget(name: str, value, zero_ok: bool) -> None:
    """A time budget in ms: a number > 0 (>= 0 with ``zero_ok``), or None."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not zero_ok):
        raise ValueError(f"{name} must be a number {'>=' if zero_ok else '>'} 0 or None, got {value!r}")


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
