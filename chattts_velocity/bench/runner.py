"""Runs every (path, batch) variant of a benchmark on one random model and gathers the report."""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import platform
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from importlib import metadata

import torch
from tqdm import tqdm

from .. import reference
from ..audio import AudioDecoder
from ..engine import EngineConfig, LLMEngine
from ..gc_freeze import freeze_long_lived
from ..model.checkpoint import write_checkpoint
from ..model.loader import LoadedModel, ModelLoader
from ..text import decorate_code_prompts
from .config import BenchConfig
from .measure import (
    DEFINITIONS,
    TTFA_TOKENS,
    Clock,
    GenerationTiming,
    MemoryMeter,
    median_row,
    speedup_row,
    variant_row,
)
from .paths import BenchPrompt, run_reference, run_velocity, time_audio
from .report import format_table, plot, prepare_output, require_matplotlib, write_json

# 36 prompt tokens once decorated as a code prompt with [speed_5] (random checkpoints' tokenizer).
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog."
PATHS = ("reference", "velocity")


@dataclass
class _Context:
    config: BenchConfig
    model: LoadedModel
    device: torch.device
    prompt: BenchPrompt
    decoder: AudioDecoder
    clock: Clock
    meter: MemoryMeter


def load_model(size: str, device: torch.device, seed: int) -> LoadedModel:
    """Random weights: the real shapes in memory (``full``), or a tiny checkpoint read back from a temp
    dir."""
    if size == "full":
        return ModelLoader(device, "dummy").load(None, seed=seed)
    with tempfile.TemporaryDirectory() as root:
        write_checkpoint(root, "tiny", seed=seed)
        return ModelLoader(device, "safetensors").load(root)


def bench_prompt(model: LoadedModel, tokens: int, device: torch.device) -> BenchPrompt:
    text = decorate_code_prompts([PROMPT_TEXT], "[speed_5]", None, False)
    ids, mask, text_mask = model.tokenizer.encode(text, model.config.num_vq, device=device)
    limit = model.config.max_position_embeddings
    if ids.shape[1] + tokens > limit:
        raise ValueError(
            f"--tokens {tokens} plus the {ids.shape[1]}-token prompt exceed the model's context of "
            f"{limit} positions; use --tokens {limit - ids.shape[1]} or fewer"
        )
    return BenchPrompt(ids[0], mask[0], text_mask[0])


def engine_config(config: BenchConfig, batch: int, seq_len: int) -> EngineConfig:
    """The engine for one batch: room for all of it at once, KV cache sized to what it needs unless given."""
    settings: dict = dict(
        dtype=config.resolved_dtype,
        max_num_seqs=config.max_num_seqs or batch,
        enable_prefix_caching=config.prefix_caching,
    )
    if config.kv_cache_gib is not None:
        settings["kv_cache_gib"] = config.kv_cache_gib
    else:
        default = EngineConfig()
        need = batch * math.ceil(seq_len / default.block_size)
        # Admissions keep the watermark's share of blocks free; one spare block absorbs the rounding.
        settings["num_kv_blocks"] = math.ceil(need / (1 - default.watermark)) + 1
    if config.enforce_eager:
        if "enforce_eager" not in {f.name for f in fields(EngineConfig)}:
            raise ValueError(
                "--enforce-eager: this engine has no enforce_eager setting (no CUDA graphs to turn off)"
            )
        settings["enforce_eager"] = True
    return EngineConfig(**settings)


def _measure(ctx: _Context, path: str, batch: int, generate: Callable[[int], GenerationTiming]) -> dict:
    """Warm up (a short run, and the wav decode at the timed run's exact shapes), then the timed runs; the
    median of their figures."""
    cfg, padded = ctx.config, path == "reference"
    generate(min(cfg.tokens, TTFA_TOKENS))
    # Full-length shapes: the first decode at a new length pays one-off costs (FFT plans, conv algorithm
    # choice), which would otherwise land on whichever path decodes that length first.
    silence = torch.zeros(cfg.tokens, ctx.model.config.hidden_size, device=ctx.device)  # [T, H]
    time_audio(ctx.decoder, [silence] * batch, cfg.decode_batch, padded, ctx.clock)
    rows = []
    for _ in range(cfg.repeats):
        ctx.meter.reset()
        gen = generate(cfg.tokens)
        audio = time_audio(ctx.decoder, gen.hiddens, cfg.decode_batch, padded, ctx.clock)
        rows.append(variant_row(path, batch, cfg.tokens, gen, audio, ctx.meter.peak_gib()))
        del gen
    return median_row(rows)


def _measure_reference(ctx: _Context, batch: int) -> dict:
    def generate(tokens: int) -> GenerationTiming:
        return run_reference(ctx.model.gpt, ctx.prompt, batch, tokens, ctx.model.config.eos_code, ctx.clock)

    return _measure(ctx, "reference", batch, generate)


def _measure_velocity(ctx: _Context, batch: int) -> dict:
    seq_len = ctx.prompt.ids.shape[0] + ctx.config.tokens
    engine = LLMEngine.from_model(ctx.model, engine_config(ctx.config, batch, seq_len), ctx.device)

    def generate(tokens: int) -> GenerationTiming:
        return run_velocity(engine, ctx.prompt, batch, tokens, ctx.config.seed, ctx.clock)

    return _measure(ctx, "velocity", batch, generate)


def variants(config: BenchConfig) -> list[tuple[str, int]]:
    return [
        (path, b) for b in config.batches for path in PATHS if path == "velocity" or config.runs_reference(b)
    ]


def run_bench(config: BenchConfig) -> dict:
    """Measure every variant; the report: ``meta``, ``definitions``, ``rows`` and ``speedups``."""
    device = torch.device(config.resolved_device)
    torch.manual_seed(config.seed)
    model = load_model(config.size, device, config.seed)
    if device.type == "cuda":  # as ``Chat.load`` does: the model's objects out of full collections' scans
        freeze_long_lived()
    meter = MemoryMeter(device)
    ctx = _Context(
        config,
        model,
        device,
        bench_prompt(model, config.tokens, device),
        AudioDecoder(model.dvae, model.decoder, model.vocos, device),
        Clock(device),
        meter,
    )
    measure = {"reference": _measure_reference, "velocity": _measure_velocity}
    rows = []
    bar = tqdm(variants(config), desc="bench", unit="variant", disable=not config.show_progress)
    with _quiet_reference():
        for path, batch in bar:
            bar.set_postfix_str(f"{path} batch {batch}")
            meter.reset()  # frees the previous variant's engine before the next one allocates
            rows.append(measure[path](ctx, batch))
    return {"meta": _meta(ctx), "definitions": DEFINITIONS, "rows": rows, "speedups": _speedups(rows)}


@contextlib.contextmanager
def _quiet_reference() -> Iterator[None]:
    """Forced lengths always end at max_new_token, which the reference loop warns about at every run."""
    logger = logging.getLogger(reference.__name__)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _speedups(rows: list[dict]) -> list[dict]:
    by_key = {(r["path"], r["batch"]): r for r in rows}
    return [
        speedup_row(by_key[("reference", b)], r)
        for (path, b), r in by_key.items()
        if path == "velocity" and ("reference", b) in by_key
    ]


def _meta(ctx: _Context) -> dict:
    cfg, device = ctx.config, ctx.device
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "python": platform.python_version(),
        "size": cfg.size,
        "dtype": cfg.resolved_dtype,
        "reference_dtype": str(next(ctx.model.gpt.parameters()).dtype).removeprefix("torch."),
        "tokens": cfg.tokens,
        "batches": list(cfg.batches),
        "prompt_text": PROMPT_TEXT,
        "prompt_tokens": int(ctx.prompt.ids.shape[0]),
        "ttfa_tokens": TTFA_TOKENS,
        "decode_batch": cfg.decode_batch,
        "repeats": cfg.repeats,
        "seed": cfg.seed,
        "engine": {
            "max_num_seqs": cfg.max_num_seqs or "batch",
            "kv_cache_gib": cfg.kv_cache_gib or "sized to the batch",
            "prefix_caching": cfg.prefix_caching,
            "enforce_eager": cfg.enforce_eager,
        },
        "cpu_threads": torch.get_num_threads(),
        "peak_mem_kind": ctx.meter.kind,
        "command": cfg.command(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {platform.processor() or platform.machine()} ({os.cpu_count()} cores, {sys.platform})"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def run_and_report(config: BenchConfig) -> dict:
    """Check the outputs can be written, run the benchmark, then write the JSON (and chart) and print the
    table."""
    if config.plot_path is not None:
        require_matplotlib()
        prepare_output(config.plot_path)
    prepare_output(config.json_path)
    report = run_bench(config)
    write_json(report, config.json_path)
    print(format_table(report))
    print(f"wrote {config.json_path}")
    if config.plot_path is not None:
        plot(report, config.plot_path)
        print(f"wrote {config.plot_path}")
    return report
