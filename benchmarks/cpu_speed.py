"""Where the CPU engine's time goes, per engine dtype, on the full-size random model; every comparison runs in one
process with its variants taking turns (variant after variant, round after round) so that a busy shared box
slows them alike, and the median (and the best) is reported.

- ``linears``: one GEMM of each of the GPT's shapes in each weight format the CPU could use: float32 as stored,
  the ``CpuWeight`` formats (fbgemm float16, oneDNN bfloat16, int8 weight-only), and the candidates left out
  (plain bfloat16 matmuls, oneDNN float16, int8 weight-only with float32 activations, torch's dynamic int8
  linear, which quantizes the activations per call and so gives a row other bits in another batch). Each
  call takes the next of 20 copies of the weight (one per layer), so the weights stream from memory as in a
  decode step.
- ``step``: the velocity engine's decode step, one engine per dtype running the same batch, their 32-step
  windows timed in turn.
- ``audio``: the wav decode (Decoder + Vocos) of one sequence at the offline length and at each stream
  window's length, float32 against bfloat16 autocast (with the SNR of its wav against float32's).
- ``rounds``: what the audio pump's rounds cost the thread that runs them, on the host, at ``--streams``
  streams of 500 tokens handed over in 8-step windows (a loaded GPU server's engine thread runs one after
  each window): the windows' decode is a stand-in for a CUDA graph replay whose device work is free (the
  copy into its input, zeros out), so what is timed is the rounds' own work; feeds that deliver every round
  (a progress bar's) against those that deliver only with audio (a server's). Here the windows' copies are
  memory copies of ``--hidden`` floats a token (on a GPU, device copies the host only launches): ``--hidden 8``
  leaves the rounds' Python and torch calls.

    python benchmarks/cpu_speed.py --parts linears step audio --batch 1 8
    python benchmarks/cpu_speed.py --parts rounds --streams 64 256 --hidden 768 8
"""

from __future__ import annotations

import argparse
import functools
import inspect
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from chattts_velocity.audio import AudioDecoder, AudioPump, StreamConfig
from chattts_velocity.audio.pump import PENDING
from chattts_velocity.bench.agreement import snr_db
from chattts_velocity.bench.runner import bench_prompt, load_model
from chattts_velocity.engine import (
    EngineConfig,
    FinishReason,
    LLMEngine,
    Prompt,
    RequestOutput,
    RequestStream,
    SamplingParams,
)
from chattts_velocity.engine.engine_config import ENGINE_DTYPES
from chattts_velocity.kernels.linear import CpuWeight

SHAPES = {"qkv": (2304, 768), "o": (768, 768), "gate/up": (6144, 768), "down": (768, 3072),
          "code heads": (2504, 768), "text head": (21178, 768)}
WINDOW = 32
COPIES = 20


def turns(fs: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each of ``fs`` (returning a time) called once a round, in turn."""
    times: dict[str, list[float]] = {name: [] for name in fs}
    for _ in range(rounds):
        for name, f in fs.items():
            times[name].append(f())
    return times


def ms_per_call(calls: list[Callable[[], object]], per: int = 1) -> Callable[[], float]:
    """A function that makes every call of ``calls`` once and returns ms per ``per`` units of them (a call,
    default; a window's steps)."""
    def run() -> float:
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) * 1e3 / (len(calls) * per)
    return run


def summary(times: dict[str, list[float]]) -> str:
    return "  ".join(f"{k} {statistics.median(t):.3f} (best {min(t):.3f})" for k, t in times.items())


def formats(w: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Each format's call for weight ``w`` [N, K] and float32 rows ``x`` [M, K]."""
    kept = {fmt: CpuWeight(w, fmt) for fmt in ("float16", "bfloat16", "int8")}
    wb = w.bfloat16()
    onednn_fp16 = torch.ops.onednn.linear_prepack_fp16(w.half(), None)
    scales = w.abs().amax(1).clamp(min=1e-12) / 127
    dynamic = torch.ao.nn.quantized.dynamic.Linear(w.size(1), w.size(0), bias_=False)
    dynamic.set_weight_bias(torch.quantize_per_channel(w, scales.double(), torch.zeros(w.size(0), dtype=torch.long),
                                                       0, torch.qint8), None)
    return {
        "float32": lambda: F.linear(x, w),
        **{fmt: (lambda weight=weight: weight(x)) for fmt, weight in kept.items()},
        "bf16 matmul": lambda: F.linear(x.bfloat16(), wb).float(),
        "onednn fp16": lambda: torch.ops.onednn.linear_dynamic_fp16(x, onednn_fp16, None),
        "int8 f32-in": lambda: torch.ops.aten._weight_int8pack_mm(x, kept["int8"].data, kept["int8"].scale.float()),
        "int8 dynamic": lambda: dynamic(x),
    }


def linears(rows: list[int], rounds: int) -> None:
    print("linears: ms a call (each call on the next of 20 weights)")
    for m in rows:
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k)
            copies = [formats(torch.randn(n, k) * 0.02, x) for _ in range(COPIES)]
            times = turns({fmt: ms_per_call([c[fmt] for c in copies]) for fmt in copies[0]}, rounds)
            print(f"  M={m} {name} [{n}x{k}]: {summary(times)}", flush=True)


def started(model, dtype: str, prompt: Prompt, batch: int, tokens: int) -> LLMEngine:
    """An engine with ``batch`` requests past their prefill and first (short) window."""
    engine = LLMEngine.from_model(model, EngineConfig(dtype=dtype, max_num_seqs=batch, kv_cache_gib=0.5), "cpu")
    for i in range(batch):
        engine.add_request(str(i), prompt, SamplingParams(min_new_tokens=tokens, max_new_tokens=tokens, seed=i))
    engine.step()
    engine.step()
    return engine


def with_threads(threads: int, call: Callable[[], float]) -> float:
    torch.set_num_threads(threads)
    return call()


def steps(model, batches: list[int], dtypes: list[str], threads: list[int], rounds: int) -> None:
    tokens = 16 + WINDOW * (rounds * len(threads) + 1)
    bp = bench_prompt(model, tokens, torch.device("cpu"))
    prompt = Prompt(bp.ids, bp.text_mask)
    print(f"step: ms a decode step ({rounds} windows of {WINDOW} steps per dtype and thread count)")
    for batch in batches:
        engines = {dtype: started(model, dtype, prompt, batch, tokens) for dtype in dtypes}
        runs = {f"{dtype} ({n} threads)" if len(threads) > 1 else dtype:
                functools.partial(with_threads, n, ms_per_call([engine.step], WINDOW))
                for dtype, engine in engines.items() for n in threads}
        print(f"  batch {batch}: {summary(turns(runs, rounds))}", flush=True)
        del engines


def audio(model, tokens: int, rounds: int) -> None:
    decoder = AudioDecoder(model.dvae, model.decoder, model.vocos, torch.device("cpu"))
    print("audio: ms to decode one sequence (Decoder + Vocos); bfloat16 autocast's wav SNR against float32")
    for length in (tokens, *StreamConfig().window_lengths()):
        hidden = torch.randn(length, model.config.hidden_size)  # unit RMS, like the final norm's output
        wavs: dict[bool, np.ndarray] = {}
        runs = {name: ms_per_call([functools.partial(decode, decoder, hidden, bf16, wavs)])
                for name, bf16 in (("float32", False), ("bf16 autocast", True))}
        times = turns(runs, rounds)
        print(f"  {length} tokens ({length / 46.875:.2f} s of audio): {summary(times)}; bf16 SNR "
              f"{snr_db(wavs[False], wavs[True]):.1f} dB", flush=True)


CAN_HOLD = "every_round" in inspect.signature(AudioPump.open).parameters


class FreeReplay:
    """Stands in for ``AudioDecoder.graphs``: copies a batch into a static input and returns a static output
    (zeros), as a replay does."""

    def __init__(self):
        self.buffers: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def run(self, x: torch.Tensor, tf32: bool) -> torch.Tensor:
        b, _, t = x.shape
        if x.shape not in self.buffers:
            self.buffers[x.shape] = torch.empty(x.shape), torch.zeros(b, (2 * t - 1) * 256)
        inp, out = self.buffers[x.shape]
        inp.copy_(x)
        return out


def rounds(streams: list[int], hiddens: list[int], rounds_: int, tokens: int = 500, steps: int = 8) -> None:
    print(f"rounds: ms of host time an audio round, {tokens} tokens a stream in windows of {steps} steps")
    for hidden in hiddens:
        for n in streams:
            runs = {name: functools.partial(round_ms, n, tokens, steps, hidden, every)
                    for name, every in (("every round", True), ("with audio", False)) if every or CAN_HOLD}
            print(f"  {n} streams, {hidden} floats a token: {summary(turns(runs, rounds_))}", flush=True)


def round_ms(n: int, tokens: int, steps: int, hidden: int, every_round: bool) -> float:
    """One run of ``n`` streams through an ``AudioPump`` (their readers drained between rounds, untimed): ms
    per round spent in ``wake``."""
    audio = AudioDecoder(None, None, None, torch.device("cpu"))
    audio.graphs = FreeReplay()
    pump = AudioPump(audio)
    streams = [RequestStream(_NoEngine(), [f"r{i}"]) for i in range(n)]
    kw = {} if every_round else {"every_round": False}  # (the default: so a tree before the option runs too)
    feeds = [iter(pump.open(s, StreamConfig(), True, notify=lambda: None, **kw)) for s in streams]
    states = torch.randn(n, steps, hidden)
    spent, count, done = 0.0, 0, 0
    while done < tokens:
        k = min(steps, tokens - done)
        done += k
        for i, s in enumerate(streams):
            s.deliver(RequestOutput(f"r{i}", new_token_ids=torch.zeros(k, 4, dtype=torch.int64),
                                    new_hidden_states=states[i, :k], num_generated=done, finished=done == tokens,
                                    finish_reason=FinishReason.LENGTH if done == tokens else None), 0.0)
        start = time.perf_counter()
        pump.wake()
        spent, count = spent + time.perf_counter() - start, count + 1
        for feed in feeds:
            while next(feed, None) not in (PENDING, None):
                pass
    return spent * 1e3 / count


class _NoEngine:
    def abort(self, rid: str) -> None:
        pass


def decode(decoder: AudioDecoder, hidden: torch.Tensor, bf16: bool, out: dict[bool, np.ndarray]) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out[bf16] = decoder.to_wavs([hidden], use_decoder=True)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["linears", "step", "audio"],
                    choices=["linears", "step", "audio", "rounds"])
    ap.add_argument("--streams", type=int, nargs="+", default=[64, 256], help="rounds: streams at once")
    ap.add_argument("--hidden", type=int, nargs="+", default=[768], help="rounds: floats a token (the GPT's 768)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="rows of the linears, batch of the step")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16", "bfloat16", "int8"], choices=ENGINE_DTYPES)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=100, help="audio: the offline decode's length")
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()],
                    help="torch intra-op threads; the step part takes turns over several (default: torch's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads[0])
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median (best) over {args.rounds} rounds")
    if "linears" in args.parts:
        linears(args.batch, args.rounds)
    if "rounds" in args.parts:
        rounds(args.streams, args.hidden, args.rounds)
    if "step" in args.parts or "audio" in args.parts:
        model = load_model("full", torch.device("cpu"), 0)
        if "step" in args.parts:
            steps(model, args.batch, args.dtypes, args.threads, args.rounds)
            torch.set_num_threads(args.threads[0])
        if "audio" in args.parts:
            audio(model, args.tokens, args.rounds)


if __name__ == "__main__":
    main()
