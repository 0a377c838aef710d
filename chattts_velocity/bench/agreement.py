"""``chattts-velocity bench agreement``: how closely each CPU engine dtype follows the float32 engine (the guard
behind ``device.default_engine_dtype``). The float32 engine samples ``tokens`` codes per sequence (ChatTTS's
default code settings, EOS masked); every dtype is then fed exactly those codes (teacher forcing), step by step
through the engine's decode path, and its top-1 code of every step and codebook is compared with float32's. The
first sequence's hidden states are decoded to audio (Decoder + Vocos, offline and streamed in the engine's
windows) and each wav's SNR against float32's is reported too. ``tests/test_cpu_dtypes.py`` keeps a threshold
on the tiny checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..audio import AudioDecoder, AudioStream, StreamConfig, decode_windows
from ..engine import EngineConfig, LLMEngine, Prompt, SamplingParams
from ..engine.engine_config import CPU_WEIGHTS
from ..engine.scheduler import ScheduledSeq
from ..model.loader import LoadedModel
from .report import prepare_output, write_json
from .runner import bench_prompt, load_model


@dataclass(frozen=True)
class AgreementConfig:
    """One ``bench agreement`` run."""

    size: str = "full"
    """``full`` (the real shapes, random weights) or ``tiny``."""
    batches: tuple[int, ...] = (1, 8)
    """Sequences forced together."""
    tokens: int = 500
    """Teacher-forced steps per sequence."""
    dtypes: tuple[str, ...] = tuple(CPU_WEIGHTS)
    """The CPU engine dtypes compared with float32."""
    seed: int = 0
    """Seed of the random weights; sequence i samples its codes with seed + i."""
    json_path: str = "bench_agreement.json"
    """Where the results go."""

    def __post_init__(self) -> None:
        bad = [d for d in self.dtypes if d not in CPU_WEIGHTS]
        if bad or not self.dtypes:
            raise ValueError(f"bench agreement compares the CPU engine dtypes {', '.join(CPU_WEIGHTS)} with "
                             f"float32, got --dtype {' '.join(self.dtypes) or '(none)'}")
        if not self.batches or min(self.batches) < 1 or self.tokens < 1:
            raise ValueError("bench agreement needs --batch sizes >= 1 and --tokens >= 1")


@dataclass
class Forced:
    """One dtype's teacher-forced run: B sequences, T steps, Q codebooks."""

    top1: Tensor
    """[T, B, Q] int64: the argmax code of each step's logits."""
    hidden: Tensor
    """[T, B, H] float32: the final-norm hidden state behind each."""


def sampled_codes(model: LoadedModel, prompt: Prompt, batch: int, steps: int, seed: int = 0) -> Tensor:
    """[B, T, Q] codes the float32 engine samples with ChatTTS's default code settings (EOS masked for ``steps``
    tokens), sequence i seeded ``seed + i``: the inputs every dtype is forced through."""
    engine = LLMEngine.from_model(model, EngineConfig(dtype="float32", max_num_seqs=batch), "cpu")
    for i in range(batch):
        engine.add_request(str(i), prompt, SamplingParams(min_new_tokens=steps, max_new_tokens=steps, seed=seed + i))
    done: dict[str, Tensor] = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out.token_ids) for out in engine.step() if out.finished)
    return torch.stack([done[str(i)] for i in range(batch)])


def teacher_forced(model: LoadedModel, dtype: str, prompt: Prompt, codes: Tensor) -> Forced:
    """Run ``codes`` [B, T, Q] through a ``dtype`` engine's runner on the CPU: the prompt's prefill, then one decode
    step per forced token (the engine's decode-step path), the logits from the runner's own code heads."""
    batch, steps, _ = codes.shape
    block_size = 16
    blocks = math.ceil((prompt.ids.size(0) + steps) / block_size)
    config = EngineConfig(dtype=dtype, max_num_seqs=batch, num_kv_blocks=batch * blocks, block_size=block_size,
                          enable_prefix_caching=False)
    engine = LLMEngine.from_model(model, config, "cpu")
    runner = engine.runner
    seqs = [engine.make_sequence(str(i), prompt, SamplingParams(max_new_tokens=steps)) for i in range(batch)]
    for i, seq in enumerate(seqs):  # no scheduler here: each sequence owns a fixed run of the cache's blocks
        seq.block_table = list(range(i * blocks, (i + 1) * blocks))
    top1, hidden = [], []
    for t in range(steps):
        scheduled = [ScheduledSeq(seq, seq.num_uncomputed) for seq in seqs]
        with torch.inference_mode():
            h, last_rows = runner.forward(scheduled)
            h = h[last_rows].float()  # [B, H]
            logits = runner.sampler.code_logits(h).view(batch, codes.size(2), -1)  # [B, Q, V]
        top1.append(logits.argmax(-1))
        hidden.append(h)
        for i, seq in enumerate(seqs):
            seq.num_computed_tokens = len(seq)
            seq.extend([tuple(codes[i, t].tolist())])
    return Forced(torch.stack(top1), torch.stack(hidden))


def agreement(reference: Forced, other: Forced) -> float:
    """Share of (step, sequence, codebook) whose top-1 codes are equal."""
    return (reference.top1 == other.top1).float().mean().item()


def snr_db(reference: np.ndarray, other: np.ndarray) -> float:
    """10 log10(signal / error energy) of ``other`` against ``reference``; inf when equal."""
    err = float(np.sum((reference.astype(np.float64) - other) ** 2))
    return math.inf if err == 0 else 10 * math.log10(float(np.sum(reference.astype(np.float64) ** 2)) / err)


def _streamed(audio: AudioDecoder, hidden: Tensor) -> np.ndarray:
    """[T, H] hidden states decoded as a stream's windows (all pushed at once: the same windows)."""
    stream = AudioStream(StreamConfig())
    stream.push(hidden, finished=True)
    windows = stream.ready()
    wavs = decode_windows(audio, windows, use_decoder=True)
    return np.concatenate([stream.accept(w, wav) for w, wav in zip(windows, wavs, strict=True)])


def _wavs(audio: AudioDecoder, hidden: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The offline and the streamed wav of [T, H] hidden states."""
    return audio.to_wavs([hidden], use_decoder=True)[0], _streamed(audio, hidden)


def run_agreement(config: AgreementConfig) -> dict:
    """Every dtype at every batch: its top-1 agreement with float32 and its wavs' SNRs (the report's rows)."""
    cpu = torch.device("cpu")
    model = load_model(config.size, cpu, config.seed)
    audio = AudioDecoder(model.dvae, model.decoder, model.vocos, cpu)
    bp = bench_prompt(model, config.tokens, cpu)
    prompt = Prompt(bp.ids, bp.text_mask)
    rows = []
    for batch in config.batches:
        codes = sampled_codes(model, prompt, batch, config.tokens, config.seed)  # [B, T, Q]
        reference = teacher_forced(model, "float32", prompt, codes)
        offline, streamed = _wavs(audio, reference.hidden[:, 0])
        for dtype in config.dtypes:
            forced = teacher_forced(model, dtype, prompt, codes)
            got = _wavs(audio, forced.hidden[:, 0])
            rows.append(dict(batch=batch, dtype=dtype, agreement=agreement(reference, forced),
                             offline_snr_db=snr_db(offline, got[0]), streamed_snr_db=snr_db(streamed, got[1])))
    return dict(size=config.size, tokens=config.tokens, seed=config.seed, threads=torch.get_num_threads(),
                rows=rows)


def format_agreement(report: dict) -> str:
    lines = [f"{report['size']} model, {report['tokens']} teacher-forced steps against the float32 engine",
             "| batch | dtype | top-1 agreement | offline wav SNR dB | streamed wav SNR dB |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['dtype']} | {100 * r['agreement']:.2f}% | {r['offline_snr_db']:.1f} | "
              f"{r['streamed_snr_db']:.1f} |" for r in report["rows"]]
    return "\n".join(lines)


def run_and_report(config: AgreementConfig) -> dict:
    prepare_output(config.json_path)
    report = run_agreement(config)
    write_json(report, config.json_path)
    print(format_agreement(report))
    print(f"wrote {config.json_path}")
    return report
