"""GPU probe at the GPT's shapes (``--parts fused gemv prefetch attention
attention_sweep attention_splits sampler audio``): the fused decode linears vs the unfused ops (cuBLAS), the one-row GEMV (config sweep) vs the skinny GEMM at batch 1, decode attention by split count, by tile/warps and by split length at small batches, and the wav decode in fp32 /
TF32 / bf16 / fp16. Each kernel timing replays a CUDA graph of 20 launches over 20 distinct operands (like 20
layers, so nothing stays in L2); medians of 30 replays."""

# ruff: noqa: B023 (every closure below runs, and is captured into a CUDA graph, before its loop moves on)
from __future__ import annotations

import argparse
import statistics

import torch

from chattts_velocity import kernels


def graph_time(fn, reps: int = 30) -> float:
    """ms per replay of a CUDA graph capturing fn()."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def fused_probe(dtype, rows=(1, 16, 64, 128)) -> None:
    """The four linear roles of a layer: the fused Triton kernel (config sweep) vs the unfused ops, at each of
    ``rows`` rows (``--rows``)."""
    from chattts_velocity.kernels._triton.linear import fused_linear_triton

    roles = {"qkv+norm": (2304, 768, True, False), "o": (768, 768, False, False),
             "gate_up+norm+silu": (3072, 768, True, True), "down": (768, 3072, False, False)}
    print("\n== linear roles, 20 distinct weights per graph, us per call (unfused = rms_norm/cuBLAS/silu) ==")
    for name, (n, k, norm, gated) in roles.items():
        ws = [torch.randn(n * (2 if gated else 1), k, device="cuda", dtype=dtype) * 0.02 for _ in range(20)]
        nw = torch.ones(k, device="cuda", dtype=dtype)
        floor_us = ws[0].numel() * 2 / 3.0e12 * 1e6
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            res = torch.randn(m, k, device="cuda", dtype=dtype) if norm else None
            kw = dict(norm_weight=nw if norm else None, eps=1e-6, residual=res, gated=gated)
            out = {"unfused": graph_time(lambda: [_unfused(x, w, **kw) for w in ws]) / 20 * 1e3}
            ref = _unfused(x, ws[-1], **kw)
            ref = ref[0] if isinstance(ref, tuple) else ref
            for bn in (16, 32, 64):
                for bk in (64, 128, 256):
                    for warps in (2, 4):
                        cfg = (bn, bk, warps)
                        try:
                            def fn(cfg=cfg):
                                return [fused_linear_triton(x, w, kw["norm_weight"], 1e-6, res, gated, config=cfg)
                                        for w in ws]
                            got = fn()[-1]
                            got = got[0] if isinstance(got, tuple) else got
                            err = (got.float() - ref.float()).abs().max().item()
                            if err > 0.05:
                                print("  bad", name, m, cfg, err)
                                continue
                            out[cfg] = graph_time(fn) / 20 * 1e3
                        except Exception as e:  # noqa: BLE001 (a config that does not compile)
                            print("  fail", name, m, cfg, type(e).__name__, str(e)[:200])
            best = sorted((v, c) for c, v in out.items() if c != "unfused")[:3]
            print(f"{name:18s} M={m:4d} floor {floor_us:5.2f} unfused {out['unfused']:6.2f}  best: "
                  + ", ".join(f"{c} {v:.2f}" for v, c in best), flush=True)


def gemv_probe(dtype) -> None:
    """Batch 1: each linear role as the skinny tensor-core GEMM (its default config; for q/k/v followed by the
    rotary + KV-write launch) against the one-row GEMV with the rotation and the write fused (config sweep of
    (BLOCK_N, num_warps, programmatic dependent launch))."""
    from chattts_velocity.kernels._triton.gemv import default_config, gemv_triton
    from chattts_velocity.kernels._triton.linear import fused_linear_triton

    roles = {"qkv+norm+res+rope": (2304, 768, True, False, True), "o": (768, 768, False, False, False),
             "gate_up+norm+res+silu": (6144, 768, True, True, False), "down": (768, 3072, False, False, False)}
    cos_sin = kernels.rotary_cos_sin_cache(64, 4096, 10000.0, "cuda")
    caches = [(torch.zeros(64, 16, 12, 64, device="cuda", dtype=dtype),
               torch.zeros(64, 16, 12, 64, device="cuda", dtype=dtype)) for _ in range(20)]
    pos = torch.tensor([285], device="cuda")
    slots = torch.tensor([285], device="cuda")
    print("\n== batch 1: skinny GEMM (+ rotary/KV launch) vs one-row GEMV, 20 distinct weights, us per call ==")
    for name, (n, k, norm, gated, rope) in roles.items():
        ws = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(20)]
        nw = torch.ones(k, device="cuda", dtype=dtype)
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        res = torch.randn(1, k, device="cuda", dtype=dtype) if norm else None
        floor_us = ws[0].numel() * 2 / 3.35e12 * 1e6

        def skinny():
            for w, (kc, vc) in zip(ws, caches, strict=True):
                out = fused_linear_triton(x, w, nw if norm else None, 1e-6, res, gated)
                if rope:
                    qkv = out[0]
                    q, kk, v = qkv.view(1, 36, 64).split([12, 12, 12], dim=1)
                    kernels.rotary_store_kv(q, kk, v, pos, cos_sin, kc, vc, slots)

        def gemv(cfg):
            return [gemv_triton(x, w, nw if norm else None, 1e-6, res, gated,
                                (pos, cos_sin, kc, vc, slots, 12, 12) if rope else None, config=cfg[:2],
                                pdl=cfg[2])
                    for w, (kc, vc) in zip(ws, caches, strict=True)]

        base = graph_time(skinny) / 20 * 1e3
        ref = _unfused(x, ws[-1], norm_weight=nw if norm else None, residual=res, gated=gated)
        ref = ref[0] if isinstance(ref, tuple) else ref
        times = {}
        for bn in (1, 2, 4, 8):
            for warps in (1, 2, 4, 8):
                for pdl in (False, True):
                    cfg = (bn, warps, pdl)
                    try:
                        got = gemv(cfg)[-1]
                        got = got[0] if isinstance(got, tuple) else got
                        if not rope:  # (the rotated q/k are checked by the kernel tests)
                            err = (got.float() - ref.float()).abs().max().item()
                            if err > 0.05:
                                print("  bad", name, cfg, err)
                                continue
                        times[cfg] = graph_time(lambda cfg=cfg: gemv(cfg)) / 20 * 1e3
                    except Exception as e:  # noqa: BLE001 (a config that does not compile)
                        print("  fail", name, cfg, type(e).__name__, str(e)[:200])
        best = sorted((v, c) for c, v in times.items())[:4]
        dflt = (*default_config(n // 2 if gated else n, k, gated, rope, True), True)
        print(f"{name:22s} floor {floor_us:5.2f} skinny {base:6.2f}  default {dflt} {times.get(dflt, float('nan')):6.2f}"
              "  best: " + ", ".join(f"{c} {v:.2f}" for v, c in best), flush=True)


def _unfused(x, w, norm_weight=None, eps=1e-6, residual=None, gated=False):
    from chattts_velocity.kernels.linear import _unfused as unfused

    return unfused(x, w, norm_weight, eps, residual, gated, kernels.rms_norm, kernels.silu_and_mul)

def prefetch_probe(dtype, rows=(2, 4, 8, 16, 32, 64)) -> None:
    """2 to 64 rows: each linear role as the kernels that run it now (the skinny GEMM to 16 rows, rms_norm +
    cuBLAS + silu above; for q/k/v followed by the rotary + KV-write launch) against the two kernels that
    fetch their weights before they wait for their input under programmatic dependent launch: the prefetching
    tensor-core GEMM and the GEMV over rows (config sweeps of (BLOCK_N, num_warps)); then a whole layer's
    linears chained over 20 layers, now and with each role's fastest kernel and config."""
    from chattts_velocity.kernels._triton.gemv import gemv_triton
    from chattts_velocity.kernels._triton.linear import fused_linear_triton
    from chattts_velocity.kernels._triton.prefetch_linear import prefetch_linear_triton
    from chattts_velocity.kernels.linear import MAX_FUSED_ROWS

    roles = {"qkv+norm+res+rope": (2304, 768, True, False, True), "o": (768, 768, False, False, False),
             "gate_up+norm+res+silu": (6144, 768, True, True, False), "down": (768, 3072, False, False, False)}
    weights = {name: [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(20)]
               for name, (n, k, *_) in roles.items()}
    cos_sin = kernels.rotary_cos_sin_cache(64, 4096, 10000.0, "cuda")
    caches = [(torch.zeros(64, 16, 12, 64, device="cuda", dtype=dtype),
               torch.zeros(64, 16, 12, 64, device="cuda", dtype=dtype)) for _ in range(20)]
    nw = torch.ones(768, device="cuda", dtype=dtype)
    sweeps = {"prefetch": [(bn, w) for bn in (16, 32, 64) for w in (2, 4, 8)],
              "gemv": [(bn, w) for bn in (1, 2, 4, 8) for w in (1, 2, 4, 8)]}

    def now(name, x, w, cache, res, pos, slots, cfg=None):
        n, k, norm, gated, rope = roles[name]
        if x.shape[0] <= MAX_FUSED_ROWS:
            out = fused_linear_triton(x, w, nw if norm else None, 1e-6, res if norm else None, gated)
        else:
            out = _unfused(x, w, norm_weight=nw if norm else None, residual=res if norm else None, gated=gated)
        if rope:
            q, kk, v = out[0].view(x.shape[0], 36, 64).split([12, 12, 12], dim=1)
            kernels.rotary_store_kv(q, kk, v, pos, cos_sin, *cache, slots)
        return out

    def fetching(kind):
        kernel = prefetch_linear_triton if kind == "prefetch" else gemv_triton

        def run(name, x, w, cache, res, pos, slots, cfg):
            n, k, norm, gated, rope = roles[name]
            return kernel(x, w, nw if norm else None, 1e-6, res if norm else None, gated,
                          (pos, cos_sin, *cache, slots, 12, 12) if rope else None, config=cfg)
        return run

    print("\n== 2-64 rows: now (skinny GEMM / cuBLAS, + rotary launch) vs the prefetching GEMM and the GEMV over "
          "rows, 20 distinct weights, us per call ==")
    for m in rows:
        xs = {k: torch.randn(m, k, device="cuda", dtype=dtype) for k in (768, 3072)}
        res = torch.randn(m, 768, device="cuda", dtype=dtype)
        pos = torch.arange(200, 200 + m, device="cuda")
        slots = torch.arange(m, device="cuda") * 16
        fastest = {}  # role -> (us, kind, cfg)
        for name, (_n, k, norm, gated, rope) in roles.items():
            ws, x = weights[name], xs[k]
            base = graph_time(lambda: [now(name, x, w, c, res, pos, slots)
                                       for w, c in zip(ws, caches, strict=True)]) / 20 * 1e3
            fastest[name] = (base, "now", None)
            ref = _unfused(x, ws[-1], norm_weight=nw if norm else None, residual=res if norm else None, gated=gated)
            ref = ref[0] if isinstance(ref, tuple) else ref
            line = f"M={m:3d} {name:22s} now {base:6.2f}"
            for kind, cfgs in sweeps.items():
                fn = fetching(kind)
                times = {}
                for cfg in cfgs:
                    try:
                        got = fn(name, x, ws[-1], caches[-1], res, pos, slots, cfg)
                        got = got[0] if isinstance(got, tuple) else got
                        if not rope:  # (the rotated q/k are checked by the kernel tests)
                            err = (got.float() - ref.float()).abs().max().item()
                            if err > 0.05:
                                print("  bad", kind, name, m, cfg, err)
                                continue
                        times[cfg] = graph_time(lambda cfg=cfg: [fn(name, x, w, c, res, pos, slots, cfg)
                                                                 for w, c in zip(ws, caches, strict=True)]) / 20 * 1e3
                    except Exception as e:  # noqa: BLE001 (a config that does not compile or fit)
                        print("  fail", kind, name, m, cfg, type(e).__name__, str(e)[:120])
                best = sorted((v, c) for c, v in times.items())[:3]
                if best and best[0][0] < fastest[name][0]:
                    fastest[name] = (best[0][0], kind, best[0][1])
                line += f" | {kind}: " + ", ".join(f"{c} {v:.2f}" for v, c in best)
            print(line, flush=True)

        def layers(pick):
            for i in range(20):
                for name, (_n, k, *_) in roles.items():
                    _, kind, cfg = pick(name)
                    fn = now if kind == "now" else fetching(kind)
                    fn(name, xs[k], weights[name][i], caches[i], res, pos, slots, cfg)

        a = graph_time(lambda: layers(lambda name: (0, "now", None))) * 1e3
        b = graph_time(lambda: layers(lambda name: fastest[name])) * 1e3
        print(f"M={m:3d} 20 layers' linears: now {a:7.1f} us, each role's fastest {b:7.1f} us: "
              + ", ".join(f"{name} {kind} {cfg}" for name, (_, kind, cfg) in fastest.items()), flush=True)


def attention_probe(dtype) -> None:
    print("\n== paged decode attention, 20 layers' caches, us per layer call ==")
    heads, dim, bs = 12, 64, 16
    for batch, ctx in ((1, 286), (1, 536), (16, 286), (64, 286), (256, 286)):
        nblk_seq = -(-ctx // bs)
        nblocks = batch * nblk_seq
        caches = [(torch.randn(nblocks, bs, heads, dim, device="cuda", dtype=dtype),
                   torch.randn(nblocks, bs, heads, dim, device="cuda", dtype=dtype)) for _ in range(20)]
        q = torch.randn(batch, heads, dim, device="cuda", dtype=dtype)
        perm = torch.randperm(nblocks, device="cuda").to(torch.int32).view(batch, nblk_seq)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        bytes_ = batch * ctx * heads * dim * 2 * q.element_size()
        for width in (nblk_seq, 256):
            table = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
            table[:, :nblk_seq] = perm
            for splits in (None, 1, 2, 4, 8, 16, 32):
                def fn():
                    return [kernels.paged_decode_attention(q, kc, vc, table, lens, 0.125, num_splits=splits)
                            for kc, vc in caches]
                us = graph_time(fn) / 20 * 1e3
                print(f"b={batch:4d} ctx={ctx} width={width * bs:5d} splits={splits!s:5s} {us:7.2f} us "
                      f"{bytes_ / us / 1e3:7.1f} GB/s")


def attention_sweep(dtype) -> None:
    """The unsplit decode kernel's tile, warps and whether it loads a tile's values beside its keys, at batches
    that fill the GPU, against what the dispatch picks (``now``); every cell checked against the reference."""
    from chattts_velocity.kernels._triton import decode_attention as dec
    from chattts_velocity.kernels.attention import paged_decode_attention_ref

    print("\n== decode kernel sweep (unsplit), us per layer call (GB/s of keys and values) ==")
    heads, dim, bs = 12, 64, 16
    for batch, ctx in ((64, 286), (80, 286), (96, 286), (112, 286), (128, 286), (256, 286), (96, 1000),
                       (256, 1000)):
        nblk = -(-ctx // bs)
        caches = [(torch.randn(batch * nblk, bs, heads, dim, device="cuda", dtype=dtype),
                   torch.randn(batch * nblk, bs, heads, dim, device="cuda", dtype=dtype)) for _ in range(20)]
        q = torch.randn(batch, heads, dim, device="cuda", dtype=dtype)
        table = torch.randperm(batch * nblk, device="cuda").to(torch.int32).view(batch, nblk)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        ref = paged_decode_attention_ref(q, *caches[0], table, lens, 0.125).float()
        bytes_ = batch * ctx * heads * dim * 2 * q.element_size()
        now = graph_time(lambda: [kernels.paged_decode_attention(q, kc, vc, table, lens, 0.125)
                                  for kc, vc in caches]) / 20 * 1e3
        cells = {}
        for block_n in (16, 32, 64, 128):
            for warps in (1, 2, 4):
                for early in (False, True):
                    def fn(kc, vc, block_n=block_n, warps=warps, early=early):
                        dec._decode_kernel[(batch, heads, 1)](
                            q, kc, vc, table, lens, out, out, out, 0.125 * dec._LOG2E, q.stride(0), q.stride(1),
                            table.stride(0), nblk * bs, heads, 1, BLOCK_SIZE=bs, HEAD_DIM=dim, BLOCK_N=block_n,
                            SPLIT=False, VALUES_EARLY=early, PDL=False, num_warps=warps)
                        return out
                    try:
                        if (fn(*caches[0]).float() - ref).abs().max() > 1e-2:
                            print("  wrong", batch, ctx, block_n, warps, early)
                            continue
                        cells[(block_n, warps, early)] = graph_time(
                            lambda fn=fn: [fn(kc, vc) for kc, vc in caches]) / 20 * 1e3
                    except Exception as e:  # noqa: BLE001
                        print("  fail", block_n, warps, early, type(e).__name__)
        top = sorted((v, c) for c, v in cells.items())[:4]
        print(f"b={batch:3d} ctx={ctx:4d} now {now:6.2f} ({bytes_ / now / 1e3:4.0f}) | "
              + ", ".join(f"{c[0]}/{c[1]}{' early' if c[2] else ''} {v:.2f} ({bytes_ / v / 1e3:.0f})"
                          for v, c in top), flush=True)


def attention_splits(dtype) -> None:
    """The decode attention at small batches over a 4096-token block table (as a CUDA graph replays it), over
    several contexts: one-tile splits of the splitting kernel (tile tokens / warps, merged in the kernel, under
    programmatic dependent launch where the engine launches it so), 256-token splits of the looping kernel with
    a merge launch, and one unsplit range a pair (256-token tiles, 4 warps). Every cell checked against the
    reference. What the splitting kernel's early loads save shows only between the step's other kernels."""
    from chattts_velocity.kernels._triton import decode_attention as dec
    from chattts_velocity.kernels._triton._launch import pdl_launch
    from chattts_velocity.kernels.attention import paged_decode_attention_ref

    print("\n== decode attention at small batches, us per call ==")
    heads, dim, bs, width = 12, 64, 16, 256
    table_tokens = width * bs
    for batch in (1, 2, 4, 8, 12, 16, 21, 32, 48, 64, 80):
        pdl = pdl_launch(torch.device("cuda") if dec.launches_early(batch) else False)
        for ctx in (100, 286, 536, 1000):
            nblk = -(-ctx // bs)
            caches = [(torch.randn(batch * nblk, bs, heads, dim, device="cuda", dtype=dtype),
                       torch.randn(batch * nblk, bs, heads, dim, device="cuda", dtype=dtype)) for _ in range(20)]
            q = torch.randn(batch, heads, dim, device="cuda", dtype=dtype)
            table = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
            table[:, :nblk] = torch.randperm(batch * nblk, device="cuda").to(torch.int32).view(batch, nblk)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            ref = paged_decode_attention_ref(q, *caches[0], table, lens, 0.125).float()
            counters = torch.zeros(batch * heads, dtype=torch.int32, device="cuda")
            out = torch.empty_like(q)
            partials = {n: dec._partials(q, table_tokens // n) for n in (128, 256)}

            def tiles(kc, vc, block_n, warps):
                return dec.tile_splits(q, kc, vc, table, lens, 0.125, block_n, warps, counters, lens, pdl)

            def looping(kc, vc, block_n=256, split=True):
                grid = (batch, heads, table_tokens // block_n if split else 1)
                partial, maxes, sums = partials[block_n]
                dec._decode_kernel[grid](q, kc, vc, table, lens, partial if split else out, maxes, sums,
                                         0.125 * dec._LOG2E, q.stride(0), q.stride(1), table.stride(0),
                                         block_n if split else table_tokens, heads, 1, BLOCK_SIZE=bs,
                                         HEAD_DIM=dim, BLOCK_N=block_n, SPLIT=split, VALUES_EARLY=False, num_warps=4,
                                         **pdl)
                if split:
                    dec._merge(partial, maxes, sums, out, lens, block_n, pdl)
                return out

            variants = {f"tiles {n}/{w}": lambda kc, vc, n=n, w=w: tiles(kc, vc, n, w)
                        for n, w in ((64, 4), (128, 4), (128, 8), (256, 4), (256, 8))}
            variants["loop 256 + merge"] = looping
            variants["loop 128 + merge"] = lambda kc, vc: looping(kc, vc, block_n=128)
            variants["unsplit 256/4"] = lambda kc, vc: looping(kc, vc, split=False)
            variants["now"] = lambda kc, vc: kernels.paged_decode_attention(q, kc, vc, table, lens, 0.125)
            cells = []
            for name, fn in variants.items():
                wrong = (fn(*caches[0]).float() - ref).abs().max() > 1e-2
                us = graph_time(lambda fn=fn: [fn(kc, vc) for kc, vc in caches]) / 20 * 1e3
                cells.append(f"{name}: {us:5.2f}" + (" (wrong)" if wrong else ""))
            print(f"b={batch:2d} ctx={ctx:4d}  " + "  ".join(cells), flush=True)


def sampler_probe() -> None:
    """The fused sampler (penalty, temperature, top-p/top-k, EOS ban, the race) at the code head's vocabulary,
    a 64-entry penalty history, ChatTTS's default settings: a CUDA graph of 20 calls, us per call; the default
    warps and 1-8 warps a row, each checked against the default's ids."""
    from chattts_velocity.kernels._triton.sampling import sample_rows_triton
    from chattts_velocity.kernels.sampling import sample_rows_fused

    print("\n== fused sampler, vocab 626, history 64, us per call ==")
    for rows in (4, 8, 64, 1024):
        g = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(rows, 626, device="cuda", generator=g)
        args = (logits, torch.full((rows, 1), 0.3, device="cuda"), torch.full((rows, 1), 0.7, device="cuda"),
                torch.full((rows,), 20, dtype=torch.int64, device="cuda"),
                torch.full((rows, 1), 1.05, device="cuda"),
                torch.randint(0, 626, (rows, 64), device="cuda", generator=g),
                torch.full((rows,), 16, dtype=torch.int64, device="cuda"), torch.zeros(rows, dtype=torch.int64,
                                                                                       device="cuda"),
                torch.arange(rows, device="cuda"), torch.full((rows,), 100, dtype=torch.int64, device="cuda"),
                torch.arange(rows, device="cuda") % 4, 625)
        us = graph_time(lambda args=args: [sample_rows_fused(*args) for _ in range(20)]) / 20 * 1e3
        want = sample_rows_fused(*args)
        line = f"rows={rows:5d} {us:7.2f} us | warps"
        for warps in (1, 2, 4, 8):
            same = torch.equal(sample_rows_triton(*args, num_warps=warps), want)
            t = graph_time(lambda args=args, w=warps: [sample_rows_triton(*args, num_warps=w) for _ in range(20)])
            line += f" {warps}: {t / 20 * 1e3:.2f}" + ("" if same else " (other ids)")
        print(line, flush=True)


def audio_probe() -> None:
    from chattts_velocity.audio import AudioDecoder
    from chattts_velocity.model.loader import ModelLoader

    print("\n== wav decode of 32 x 500 hidden states (Decoder + Vocos) ==")
    model = ModelLoader(torch.device("cuda"), "dummy").load(None)
    dec = AudioDecoder(model.dvae, model.decoder, model.vocos, "cuda")
    hid = [torch.randn(500, 768, device="cuda") for _ in range(32)]
    base = dec.to_wavs(hid, True)
    for mode in ("fp32", "tf32", "bf16", "fp16"):
        torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
        torch.backends.cudnn.allow_tf32 = mode != "fp32"
        ctx = torch.autocast("cuda", dtype=torch.bfloat16 if mode == "bf16" else torch.float16,
                             enabled=mode in ("bf16", "fp16"))
        times = []
        for _ in range(4):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            with ctx:
                mel = dec.decoder.decode(torch.stack(hid).transpose(1, 2))
            b.record()
            b.synchronize()
            t_mel = a.elapsed_time(b)
            a.record()
            with ctx:
                wav = dec.vocos.decode(mel.float() if mode != "fp32" else mel).float()
            b.record()
            b.synchronize()
            times.append((t_mel, a.elapsed_time(b)))
        err = (wav.cpu().numpy() - base).std() / base.std()
        t = sorted(times)[len(times) // 2]
        print(f"{mode}: decoder {t[0]:.1f} ms, vocos {t[1]:.1f} ms, rel err {err:.2e}")
    torch.backends.cuda.matmul.allow_tf32 = False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", default=["fused", "attention", "audio"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128], help="the fused probe's batch rows")
    args = ap.parse_args()
    torch.manual_seed(0)
    if "fused" in args.parts:
        fused_probe(torch.float16, tuple(args.rows))
    if "gemv" in args.parts:
        gemv_probe(torch.float16)
    if "prefetch" in args.parts:
        prefetch_probe(torch.float16, tuple(r for r in args.rows if r > 1))
    if "attention" in args.parts:
        attention_probe(torch.float16)
    if "attention_sweep" in args.parts:
        attention_sweep(torch.float16)
    if "attention_splits" in args.parts:
        attention_splits(torch.float16)
    if "sampler" in args.parts:
        sampler_probe()
    if "audio" in args.parts:
        audio_probe()


if __name__ == "__main__":
    main()
