"""The wav decode (Decoder + Vocos) by precision, part by part, on the GPU: what the end-to-end bench pays after
the last token.

Input: the hidden states of real engine runs on full-size random weights (32 sequences x ``--tokens``), tiled
to ``--batch`` sequences and decoded ``--chunk`` at a time. Per mode: milliseconds for the Decoder, the Vocos
backbone, the head (linear, exp, iSTFT) and the copy to the host; the whole decode; and the SNR of every wav
against strict float32 (min and median over the 32 distinct sequences). Medians of ``--repeats`` runs, CUDA
events. Modes: ``tf32`` is TF32 with the ConvNeXt blocks on the fused kernels of ``audio.convnext`` (float16
activations; the default, see ``convnext.fused_default``),
``tf32-torch`` the same with the modules' torch ops,
``fused-tf32`` / ``fused-bf16`` the fused kernels with float32 (TF32) or bfloat16 activations; the rest
precision variants of the torch ops.

    python benchmarks/wav_decode.py --batch 256 --chunk 32 64 --tokens 500
    python benchmarks/wav_decode.py --buckets 16 40 --modes tf32-torch --chunk 32   # the window graphs' buckets
    python benchmarks/wav_decode.py --varied 100 --modes tf32   # sequences of different lengths, as chat.infer
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import statistics
import time

import numpy as np
import torch

from chattts_velocity.audio import AudioDecoder, convnext
from chattts_velocity.bench.measure import Clock
from chattts_velocity.bench.paths import run_velocity
from chattts_velocity.bench.runner import bench_prompt, load_model
from chattts_velocity.engine import EngineConfig, LLMEngine


def snr_db(ref: np.ndarray, x: np.ndarray) -> float:
    noise = float(((x - ref) ** 2).sum())
    return float("inf") if noise == 0 else 10 * np.log10(float((ref**2).sum()) / noise)


@contextlib.contextmanager
def precision(tf32: bool):
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = m.fp32_precision, c.fp32_precision
    m.fp32_precision = c.fp32_precision = "tf32" if tf32 else "ieee"
    try:
        yield
    finally:
        m.fp32_precision, c.fp32_precision = saved


@contextlib.contextmanager
def fused_blocks(on: bool, operands: torch.dtype):
    """The fused ConvNeXt kernels on or off (``CHATTTS_VELOCITY_FUSED_DECODE``), their activations stored and
    multiplied in ``operands``."""
    saved_env = os.environ.get("CHATTTS_VELOCITY_FUSED_DECODE")
    saved_operands = convnext.OPERANDS
    os.environ["CHATTTS_VELOCITY_FUSED_DECODE"] = "1" if on else "0"
    convnext.OPERANDS = operands
    try:
        yield
    finally:
        convnext.OPERANDS = saved_operands
        if saved_env is None:
            del os.environ["CHATTTS_VELOCITY_FUSED_DECODE"]
        else:
            os.environ["CHATTTS_VELOCITY_FUSED_DECODE"] = saved_env


class Mode:
    def __init__(self, name, model, half=None, autocast=None, tf32=False, compile_=False, fused=True,
                 operands=torch.float16):
        self.name, self.tf32, self.autocast = name, tf32, autocast
        self.fused, self.operands = fused, operands
        self.decoder, self.backbone, self.head = model.decoder, model.vocos.backbone, model.vocos.head
        if half is not None:
            self.decoder = copy.deepcopy(model.decoder).to(half)
            self.backbone = copy.deepcopy(model.vocos.backbone).to(half)
        self.half = half
        self.run_decoder = self.decoder.decode
        self.run_backbone = functools.partial(convnext.vocos_backbone, self.backbone)
        self.compiled = compile_
        if compile_:  # no inference mode under torch.compile (its functionalisation rejects inference tensors)
            self.run_decoder = torch.compile(self.decoder.decode.__wrapped__.__get__(self.decoder), dynamic=False)
            self.run_backbone = torch.compile(self.backbone, dynamic=False)

    def ctx(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self.autocast)

    def parts(self, hid: torch.Tensor, pinned: torch.Tensor | None):
        """[B, T, H] -> wav on host, with events between the parts."""
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
        grad_off = torch.no_grad() if self.compiled else torch.inference_mode()
        with grad_off, precision(self.tf32), self.ctx(), fused_blocks(self.fused, self.operands):
            ev[0].record()
            x = hid.transpose(1, 2)
            if self.compiled:
                x = x.clone()
            if self.half is not None:
                x = x.to(self.half)
            mel = self.run_decoder(x)
            ev[1].record()
            feats = self.run_backbone(mel)
            ev[2].record()
            wav = self.head(feats.float()).float()
            ev[3].record()
            if pinned is None:
                out = wav.cpu()
            else:
                out = pinned[: wav.shape[0], : wav.shape[1]]
                out.copy_(wav, non_blocking=True)
            ev[4].record()
        ev[4].synchronize()
        return out.numpy().copy(), [ev[i].elapsed_time(ev[i + 1]) for i in range(4)]


def windows_probe(model, modes, distinct: torch.Tensor, lengths: list[int], repeats: int) -> None:
    """Stream-window shapes: wall ms of ``AudioDecoder.to_wavs`` (what a pump round calls, TF32, on the
    decoder's side stream, to numpy) and device ms of each mode's parts, per batch of windows."""
    dec = AudioDecoder(model.dvae, model.decoder, model.vocos, "cuda")
    graphed = AudioDecoder(model.dvae, model.decoder, model.vocos, "cuda")
    t = time.perf_counter()
    graphed.use_graphs(lengths, capture=True)
    print(f"\ncaptured {len(graphed.graphs._graphs)} window-decode graphs in {time.perf_counter() - t:.1f} s")
    print(f"{'windows':>7s} {'W':>3s} {'to_wavs wall':>12s} {'graph wall':>10s} {'graph diff':>10s}  "
          + "  ".join(f"{m.name:>14s}" for m in modes))
    for w in lengths:
        for b in (1, 8, 32, 64, 128, 256):
            rows = [distinct[i % distinct.shape[0], (i * 7) % (distinct.shape[1] - w):][:w] for i in range(b)]
            batch = torch.stack(rows)
            walls, graph_walls = [], []
            for _ in range(repeats + 1):
                for d, store in ((dec, walls), (graphed, graph_walls)):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    with d.stream():
                        out = d.to_wavs(rows, True)
                    store.append((time.perf_counter() - t) * 1e3)
                    if d is dec:
                        eager = out
            diff = float(abs(out - eager).max() / max(abs(eager).max(), 1e-9))
            devs = []
            for m in modes:
                ts = [sum(m.parts(batch, None)[1]) for _ in range(repeats + 1)]
                devs.append(statistics.median(ts[1:]))
            print(f"{b:7d} {w:3d} {statistics.median(walls[1:]):12.2f} {statistics.median(graph_walls[1:]):10.2f} "
                  f"{diff:10.1e}  "
                  + "  ".join(f"{d:14.2f}" for d in devs), flush=True)


def buckets_probe(model, distinct: torch.Tensor, lengths: list[int], repeats: int) -> None:
    """The stream windows' CUDA graphs (``audio.graphs``, on the decoder's stream): device ms of one replay of
    each batch bucket, the fixed cost of a replay in windows (a least-squares line through them), and batches
    between buckets decoded as ``cover`` splits them against the smallest bucket that holds them."""
    from chattts_velocity.audio.graphs import BATCH_BUCKETS

    dec = AudioDecoder(model.dvae, model.decoder, model.vocos, "cuda")
    dec.use_graphs(lengths, capture=True)
    graphs = dec.graphs

    def timed(fn) -> float:
        times = []
        for _ in range(repeats + 2):
            ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.inference_mode(), dec._precision(True), dec.stream():
                ev[0].record()
                for _ in range(5):
                    fn()
                ev[1].record()
            ev[1].synchronize()
            times.append(ev[0].elapsed_time(ev[1]) / 5)
        return statistics.median(times[2:])

    for w in lengths:
        x = torch.stack([distinct[i % distinct.shape[0], (i * 7) % (distinct.shape[1] - w):][:w]
                         for i in range(max(BATCH_BUCKETS))]).transpose(1, 2).contiguous()
        ms = {b: timed(lambda b=b, x=x: graphs._replay(x[:b], b, True)) for b in BATCH_BUCKETS}
        slope, fixed = np.polyfit(list(ms), list(ms.values()), 1)
        print(f"W={w}: replay ms by bucket " + ", ".join(f"{b}: {t:.3f}" for b, t in ms.items())
              + f"; fixed {fixed:.3f} ms = {fixed / slope:.1f} windows", flush=True)
        for b in (20, 37, 100, 130, 200, 210):
            smallest = next(k for k in BATCH_BUCKETS if k >= b)
            one = timed(lambda b=b, k=smallest, x=x: graphs._replay(x[:b], k, True))
            split = timed(lambda b=b, x=x: graphs.run(x[:b], True))
            print(f"  {b:3d} windows: bucket {smallest} {one:.3f} ms, cover {graphs.plan(b, w)} "
                  f"{split:.3f} ms", flush=True)


def varied_probe(model, distinct: torch.Tensor, batch: int, shortest: int, repeats: int) -> None:
    """``AudioDecoder.to_wav_list`` (what ``chat.infer`` decodes with) of ``batch`` sequences whose lengths
    spread evenly from ``shortest`` to the hidden states' length: as it runs (rows of different lengths share
    batches, each row's padding read as zeros), against one call per length (every row decoded alone, as
    sequences of different lengths were); wall ms including the copies to the host, and the largest
    difference of a wav between the two."""
    dec = AudioDecoder(model.dvae, model.decoder, model.vocos, "cuda")
    longest = distinct.shape[1]
    rows = [distinct[i % distinct.shape[0], : shortest + (longest - shortest) * i // max(batch - 1, 1)]
            for i in range(batch)]

    def timed(fn) -> tuple[float, list[np.ndarray]]:
        walls = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            wavs = fn()
            torch.cuda.synchronize()
            walls.append(1000 * (time.perf_counter() - start))
        return statistics.median(walls[1:]), wavs

    together, wavs = timed(lambda: dec.to_wav_list(rows, True))
    alone, want = timed(lambda: [dec.to_wav_list([r], True)[0] for r in rows])
    diff = max(float(np.abs(w - a).max()) for w, a in zip(wavs, want, strict=True))
    peak = max(float(np.abs(a).max()) for a in want)
    snr = min(snr_db(a, w) for w, a in zip(wavs, want, strict=True))
    audio = sum(w.size for w in wavs) / 24000
    print(f"{batch} sequences of {shortest}-{longest} tokens ({audio:.0f} s of audio): to_wav_list {together:.1f} ms, "
          f"one call a length {alone:.1f} ms; largest difference {diff:.1e} (largest sample {peak:.2f}), "
          f"lowest SNR of a wav between the two {snr:.1f} dB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--chunk", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also torch.compile the tf32, bf16 and fp16 modes")
    ap.add_argument("--windows", type=int, nargs="*", default=[],
                    help="also time stream-window batches of these lengths (tokens), at 1 to 256 windows")
    ap.add_argument("--buckets", type=int, nargs="*", default=[],
                    help="also time the stream-window graphs' batch buckets at these window lengths (tokens)")
    ap.add_argument("--modes", nargs="+", default=None,
                    help="only these modes (fp32, the SNR reference, always runs): tf32 bf16-autocast ...")
    ap.add_argument("--varied", type=int, default=None, metavar="SHORTEST",
                    help="also time to_wav_list of --batch sequences of lengths from SHORTEST to --tokens")
    ap.add_argument("--cudnn-benchmark", action="store_true",
                    help="let cuDNN time its convolution algorithms per shape (torch.backends.cudnn.benchmark)")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = load_model("full", device, 0)
    prompt = bench_prompt(model, args.tokens, device)
    engine = LLMEngine.from_model(model, EngineConfig(dtype="float16", num_kv_blocks=32 * 40 + 64), device)
    gen = run_velocity(engine, prompt, 32, args.tokens, 0, Clock(device))
    with torch.no_grad():
        distinct = torch.stack(gen.hiddens).float().clone()  # [32, T, H], not an inference tensor
    del engine
    torch.cuda.empty_cache()
    print(f"hidden states: {tuple(distinct.shape)}, std {distinct.std().item():.3f}, "
          f"max |x| {distinct.abs().max().item():.2f}")
    hid = distinct.repeat((args.batch + 31) // 32, 1, 1)[: args.batch]

    modes = [
        Mode("fp32", model),
        Mode("tf32", model, tf32=True),
        Mode("tf32-torch", model, tf32=True, fused=False),
        Mode("fused-tf32", model, tf32=True, operands=torch.float32),
        Mode("fused-bf16", model, tf32=True, operands=torch.bfloat16),
        Mode("bf16-autocast", model, autocast=torch.bfloat16),
        Mode("fp16-autocast", model, autocast=torch.float16),
        Mode("bf16-weights", model, half=torch.bfloat16),
        Mode("fp16-weights", model, half=torch.float16),
    ]
    if args.compile:
        # torch.compile of the modules' own ops (not of the fused kernels)
        modes.append(Mode("fp16-weights+compile", model, half=torch.float16, compile_=True, fused=False))
        modes.append(Mode("tf32+compile", model, tf32=True, compile_=True, fused=False))
        modes.append(Mode("bf16-weights+compile", model, half=torch.bfloat16, compile_=True, fused=False))
    if args.modes:
        modes = [m for m in modes if m.name == "fp32" or m.name in args.modes]
    if args.varied is not None:
        varied_probe(model, distinct, args.batch, args.varied, args.repeats)
    if args.buckets:
        buckets_probe(model, distinct, args.buckets, args.repeats)
    if args.windows:
        windows_probe(model, [m for m in modes if not m.compiled], distinct, args.windows, args.repeats)
    ref, _ = modes[0].parts(distinct, None)
    print(f"{'mode':22s} {'chunk':>5s} {'decoder':>8s} {'backbone':>8s} {'head':>6s} {'d2h':>6s} "
          f"{'total ms':>9s} {'pinned':>7s} {'SNR min':>8s} {'SNR p50':>8s}")
    for mode in modes:
        wav, _ = mode.parts(distinct, None)
        snrs = [snr_db(r, w) for r, w in zip(ref, wav, strict=True)]
        for chunk in args.chunk:
            pinned = torch.empty((chunk, ref.shape[1]), dtype=torch.float32, pin_memory=True)
            for p in (None, pinned):  # warm both
                mode.parts(hid[:chunk], p)
            runs, pinned_runs = [], []
            for _ in range(args.repeats):
                for store, p in ((runs, None), (pinned_runs, pinned)):
                    torch.cuda.synchronize()
                    total = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    total[0].record()
                    parts = [0.0] * 4
                    for i in range(0, args.batch, chunk):
                        _, t = mode.parts(hid[i : i + chunk], p)
                        parts = [a + b for a, b in zip(parts, t, strict=True)]
                    total[1].record()
                    total[1].synchronize()
                    store.append((total[0].elapsed_time(total[1]), parts))
            t, parts = sorted(runs)[len(runs) // 2]
            tp = statistics.median(r[0] for r in pinned_runs)
            print(f"{mode.name:22s} {chunk:5d} {parts[0]:8.1f} {parts[1]:8.1f} {parts[2]:6.1f} {parts[3]:6.1f} "
                  f"{t:9.1f} {tp:7.1f} {min(snrs):8.1f} {statistics.median(snrs):8.1f}", flush=True)


if __name__ == "__main__":
    main()
