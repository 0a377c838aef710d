"""``BenchConfig``: what one ``chattts-velocity bench`` run measures, validated before anything is loaded."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import torch

from ..device import default_engine_dtype, resolve_device
from ..engine.engine_config import ENGINE_DTYPES

SIZES = ("tiny", "full")
DTYPES = ENGINE_DTYPES
DEFAULT_BATCHES = (1, 16, 64, 256)


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run: model size, batches, generation length, device and engine settings."""

    size: str = "full"
    """``full`` (the real shapes, random weights) or ``tiny`` (a small random checkpoint)."""
    batches: tuple[int, ...] = DEFAULT_BATCHES
    """Batch sizes; every batch is one set of concurrent requests submitted at once."""
    tokens: int = 500
    """Audio tokens generated per sequence, exactly (EOS is masked until then)."""
    device: str | None = None
    """Torch device; None: cuda if available, else cpu."""
    dtypes: tuple[str, ...] = ()
    """Velocity engine dtypes, one velocity variant each; empty: the device's default
    (``device.default_engine_dtype``; float32 for the tiny model on the CPU). The reference runs as loaded
    (float32, as upstream)."""
    json_path: str = "bench.json"
    """Where the results go."""
    plot_path: str | None = None
    """PNG chart of the results (needs matplotlib); None: no chart."""
    skip_reference: bool = False
    """Measure the velocity engine only."""
    reference_max_batch: int | None = None
    """Largest batch the reference runs (it is slow at large batches); None: every batch."""
    seed: int = 0
    """Seed of the random weights and of sampling."""
    repeats: int = 1
    """Timed runs per variant; every reported figure is the median over them."""
    decode_batch: int = 32
    """Sequences per Decoder+Vocos call when decoding the wavs (bounds the audio stage's memory)."""
    max_num_seqs: int | None = None
    """Engine: sequences decoded together; None: the batch, so a whole batch runs at once."""
    kv_cache_gib: float | None = None
    """Engine: KV cache memory; None: exactly what the batch needs (so peak memory stays comparable)."""
    prefix_caching: bool = False
    """Engine: share the KV of equal prompt prefixes. Off by default: every request of a batch has the same
    prompt, which real traffic does not, and the warm-up run would fill the cache for the timed one; sharing
    would flatter the prefill."""
    enforce_eager: bool = False
    """Engine: no CUDA graphs (only where ``EngineConfig`` has ``enforce_eager``)."""
    show_progress: bool = True
    """A progress bar over the variants."""

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"--size must be one of {', '.join(SIZES)}, got {self.size!r}")
        if not self.batches:
            raise ValueError("--batch needs at least one batch size")
        for b in self.batches:
            _positive("--batch", b)
        if len(set(self.batches)) != len(self.batches):
            raise ValueError(f"--batch sizes must be distinct, got {list(self.batches)}")
        if not _is_int(self.tokens) or self.tokens < 2:
            raise ValueError(
                f"--tokens must be an int >= 2 (one prefill step and at least one decode step), "
                f"got {self.tokens!r}"
            )
        for dtype in self.dtypes:
            if dtype not in DTYPES:
                raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if len(set(self.dtypes)) != len(self.dtypes):
            raise ValueError(f"--dtype values must be distinct, got {list(self.dtypes)}")
        if self.reference_max_batch is not None:
            _positive("--reference-max-batch", self.reference_max_batch)
        if self.max_num_seqs is not None:
            _positive("--max-num-seqs", self.max_num_seqs)
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"--kv-cache-gib must be > 0, got {self.kv_cache_gib!r}")
        _positive("--repeats", self.repeats)
        _positive("--decode-batch", self.decode_batch)
        self._check_device()

    def _check_device(self) -> None:
        try:
            device = torch.device(self.resolved_device)
        except RuntimeError:
            raise ValueError(
                f"--device must be a torch device such as cuda or cpu, got {self.device!r}"
            ) from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but CUDA is not available; use --device cpu")
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"--device must be cuda or cpu, got {self.device!r}")

    @property
    def resolved_device(self) -> str:
        return self.device if self.device is not None else str(resolve_device(None))

    @property
    def resolved_dtypes(self) -> tuple[str, ...]:
        """``dtypes``, else the device's default, except the tiny model on the CPU: float32, since its matrices
        are a few KiB and a packed CPU format only adds per-call cost to them (docs/perf/cpu.md)."""
        if self.dtypes:
            return self.dtypes
        if self.size == "tiny" and resolve_device(self.resolved_device).type == "cpu":
            return ("float32",)
        return (default_engine_dtype(self.resolved_device),)

    def runs_reference(self, batch: int) -> bool:
        return not self.skip_reference and (
            self.reference_max_batch is None or batch <= self.reference_max_batch
        )

    def command(self) -> str:
        """The command line that repeats this run, every default spelled out."""
        parts = [
            "chattts-velocity",
            "bench",
            "--size",
            self.size,
            "--batch",
            *map(str, self.batches),
            "--tokens",
            str(self.tokens),
            "--device",
            self.resolved_device,
            "--dtype",
            *self.resolved_dtypes,
            "--json",
            self.json_path,
            "--seed",
            str(self.seed),
            "--repeats",
            str(self.repeats),
            "--decode-batch",
            str(self.decode_batch),
        ]
        optional = [
            ("--plot", self.plot_path),
            ("--reference-max-batch", self.reference_max_batch),
            ("--max-num-seqs", self.max_num_seqs),
            ("--kv-cache-gib", self.kv_cache_gib),
        ]
        parts += [x for flag, value in optional if value is not None for x in (flag, str(value))]
        flags = [
            ("--skip-reference", self.skip_reference),
            ("--prefix-caching", self.prefix_caching),
            ("--enforce-eager", self.enforce_eager),
        ]
        return shlex.join(parts + [flag for flag, on in flags if on])


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(name: str, value) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
