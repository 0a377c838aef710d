#!/usr/bin/env bash
# On the GPU machine: run named steps, each under its own time limit, logging each to <step>.log, all packed into $OUT/round.tgz at the end.
# Steps: tests (the gpu-marked tests), latency (where one stream's first audio goes), prefill (a lone prompt's prefill step), trace (a batch-1 decode
# step kernel by kernel), refine (the refine pass, reference vs velocity), serve (benchmarks/gpu_serve.sh with a GIL profile), synth (the full-size
# synth-vs-loop row), bench (the issue-12 engine sweep). Usage: bash benchmarks/gpu_round.sh tests serve synth
set -u
FINAL=${OUT:-/tmp/out}; OUT=/tmp/round; mkdir -p "$FINAL" "$OUT/serve"
trap 'tar -czf "$FINAL/round.tgz" -C "$OUT" .' EXIT  # one file back (the device returns at most 8)
export PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
step() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0))s"
    tail -${TAIL:-25} "$OUT/$name.log"
}
for s in "$@"; do
    case $s in
        tests) step tests "${TESTS_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py \
                   tests/test_gpu_engine.py tests/test_kernels.py tests/test_sampler.py tests/test_sampling_kernel.py ;;
        timeline) step timeline "${TIMELINE_S:-240}" python3 benchmarks/serve_timeline.py --streams 8 64 256 \
                   --requests 2 --tokens 500 ;;
        latency) step latency "${LATENCY_S:-120}" python3 benchmarks/stream_latency.py --runs 3 --tokens 200 ;;
        prefill) step prefill "${PREFILL_S:-120}" python3 benchmarks/prefill_trace.py ;;
        trace) step trace "${TRACE_S:-120}" python3 benchmarks/step_trace.py --batch 1 ;;
        refine) step refine "${REFINE_S:-240}" python3 benchmarks/refine_speed.py --size full --device cuda \
                   --batch 1 8 64 --tokens 100 --repeats 3 ;;
        serve) PROFILE=1 OUT=$OUT/serve step serve "${SERVE_S:-240}" bash benchmarks/gpu_serve.sh ;;
        synth) step synth "${SYNTH_S:-180}" python3 benchmarks/synth_throughput.py --dummy --lines 512 \
                   --max-new-token 300 --device cuda --engine-dtype float16 --loop-lines 32 ;;
        bench) step bench "${BENCH_S:-420}" chattts-velocity bench --batch 1 16 64 256 --tokens 500 --repeats 3 \
                   --json "$OUT/bench.json" --plot "$OUT/bench.png" ;;
        *) echo "unknown step $s"; exit 2 ;;
    esac
done
