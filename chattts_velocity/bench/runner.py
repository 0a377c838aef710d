"""Runs every (path, dtype, batch) variant of a benchmark on one random model and gathers the report."""

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


def engine_config(config: BenchConfig, batch: int, seq_len: int, dtype: str | None = None) -> EngineConfig:
    """The engine for one batch: room for all of it at once, KV cache sized to what it needs unless given;
    ``dtype`` (default: the first of the run's)."""
    settings: dict = dict(
        dtype=dtype or config.resolved_dtypes[0],
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


@dataclass
class _Variant:
    """One measured (path, dtype) at one batch: how it generates, and its timed runs' rows."""

    path: str
    dtype: str
    generate: Callable[[int], GenerationTiming]
    rows: list[dict]


def _specs(ctx: _Context, batch: int) -> list[tuple[str, str]]:
    """The batch's (path, dtype) variants: the reference (where it runs at this batch), then each velocity dtype."""
    reference = [("reference", reference_dtype(ctx.model))] if ctx.config.runs_reference(batch) else []
    return reference + [("velocity", dtype) for dtype in ctx.config.resolved_dtypes]


def _variant(ctx: _Context, batch: int, path: str, dtype: str) -> _Variant:
    cfg, model = ctx.config, ctx.model
    if path == "reference":
        def reference_run(tokens: int) -> GenerationTiming:
            return run_reference(model.gpt, ctx.prompt, batch, tokens, model.config.eos_code, ctx.clock)

        return _Variant(path, dtype, reference_run, [])
    seq_len = ctx.prompt.ids.shape[0] + cfg.tokens
    engine = LLMEngine.from_model(model, engine_config(cfg, batch, seq_len, dtype), ctx.device)

    def velocity_run(tokens: int) -> GenerationTiming:
        return run_velocity(engine, ctx.prompt, batch, tokens, cfg.seed, ctx.clock)

    return _Variant(path, dtype, velocity_run, [])


def _warm_up(ctx: _Context, variant: _Variant, batch: int) -> None:
    """A short run, and the wav decode at the timed runs' exact shapes: the first decode at a new length pays
    one-off costs (FFT plans, conv algorithm choice), which would otherwise land on whichever variant decodes
    that length first."""
    cfg = ctx.config
    variant.generate(min(cfg.tokens, TTFA_TOKENS))
    silence = torch.zeros(cfg.tokens, ctx.model.config.hidden_size, device=ctx.device)  # [T, H]
    time_audio(ctx.decoder, [silence] * batch, cfg.decode_batch, variant.path == "reference", ctx.clock)


def _timed_run(ctx: _Context, variant: _Variant, batch: int) -> None:
    cfg = ctx.config
    ctx.meter.reset()
    gen = variant.generate(cfg.tokens)
    audio = time_audio(ctx.decoder, gen.hiddens, cfg.decode_batch, variant.path == "reference", ctx.clock)
    variant.rows.append(variant_row(variant.path, variant.dtype, batch, cfg.tokens, gen, audio,
                                    ctx.meter.peak_gib()))


def _measure_batch(ctx: _Context, batch: int, bar: tqdm) -> list[dict]:
    """Each variant's medians. On the CPU every variant is built and warmed up, then their timed runs take
    turns (variant after variant, repeat after repeat), so that a machine busy with something else slows them
    alike; on CUDA one variant at a time, so that each one's peak memory is its own."""
    specs = _specs(ctx, batch)
    groups = [specs] if ctx.device.type == "cpu" else [[spec] for spec in specs]
    rows = []
    for group in groups:
        ctx.meter.reset()  # frees the previous variants' engines before these allocate
        variants = [_variant(ctx, batch, path, dtype) for path, dtype in group]
        for variant in variants:
            _warm_up(ctx, variant, batch)
        for _ in range(ctx.config.repeats):
            for variant in variants:
                bar.set_postfix_str(f"{variant.path} {variant.dtype} batch {batch}")
                _timed_run(ctx, variant, batch)
                bar.update()
        rows += [median_row(v.rows) for v in variants]
        del variants
    return rows


def reference_dtype(model: LoadedModel) -> str:
    return str(next(model.gpt.parameters()).dtype).removeprefix("torch.")


def num_variants(config: BenchConfig) -> int:
    """How many (path, dtype, batch) variants the run measures."""
    return sum(len(config.resolved_dtypes) + config.runs_reference(b) for b in config.batches)


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
    rows = []
    bar = tqdm(total=num_variants(config) * config.repeats, desc="bench", unit="run",
               disable=not config.show_progress)
    with _quiet_reference():
        for batch in config.batches:
            rows += _measure_batch(ctx, batch, bar)
    bar.close()
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
    """Each velocity row over the reference row of its batch."""
    reference = {r["batch"]: r for r in rows if r["path"] == "reference"}
    return [speedup_row(reference[r["batch"]], r) for r in rows
            if r["path"] == "velocity" and r["batch"] in reference]


def _meta(ctx: _Context) -> dict:
    cfg, device = ctx.config, ctx.device
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "python": platform.python_version(),
        "size": cfg.size,
        "dtype": cfg.resolved_dtypes[0],
        "dtypes": list(cfg.resolved_dtypes),
        "reference_dtype": reference_dtype(ctx.model),
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
