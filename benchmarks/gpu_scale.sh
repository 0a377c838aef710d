#!/usr/bin/env bash
# On a machine with 2 GPUs: the speech server alone (one process), then on Ray Serve with 1 replica and with 2
# replicas (one per GPU), each driven by the same `chattts-velocity bench serve` run. JSON (and the servers' logs
# and /metrics) under $OUT: bench_single.json, bench_replicas1.json, bench_replicas2.json, then a summary of
# aggregate real-time factor at the largest level (2 replicas / 1 replica, target >= 1.9) and time to first audio
# p50 at 1 stream (1 replica / single process, target <= 1.10).
# Usage: bash benchmarks/gpu_scale.sh [extra serve args...]
#   STREAMS="1 512" MAX_NEW=500 PORT=8011; RUNS="single replicas1 replicas2" (a subset fits a shorter session;
#   the summary reads whichever bench_*.json files $OUT holds); WEIGHTS="--dummy" (or "--model DIR")
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PORT=${PORT:-8011}
STREAMS=${STREAMS:-"1 512"}
MAX_NEW=${MAX_NEW:-500}
URL="http://127.0.0.1:$PORT"

ready() {  # $1: server pid, $2: replicas (0: the single-process server)
    for _ in $(seq 1 600); do
        kill -0 "$1" 2> /dev/null || return 1
        if [ "$2" = 0 ]; then
            curl -sf "$URL/health" > /dev/null && return 0
        else  # every replica reports its series to /metrics once its engine is up
            n=$(curl -sf "$URL/metrics" | grep -c '^chattts_kv_blocks_total{') && [ "$n" -ge "$2" ] && return 0
        fi
        sleep 1
    done
    return 1
}

run() {  # $1: name, $2: replicas (0: single process), then extra serve args
    name=$1 replicas=$2; shift 2
    scale=(); [ "$replicas" -gt 0 ] && scale=(--replicas "$replicas")
    start=$SECONDS
    # shellcheck disable=SC2086
    setsid chattts-velocity serve ${WEIGHTS:---dummy} --port "$PORT" --max-concurrent 256 --max-queue 1024 \
        --max-new-token "$MAX_NEW" --log-level warning "${scale[@]}" "$@" > "$OUT/server_$name.log" 2>&1 &
    server=$!
    if ! ready $server "$replicas"; then
        echo "$name: server not ready"; tail -40 "$OUT/server_$name.log"; kill -TERM $server; wait $server; return 1
    fi
    echo "$name: ready after $((SECONDS - start)) s"
    # shellcheck disable=SC2086
    chattts-velocity bench serve --url "$URL" --streams $STREAMS --requests-per-stream 2 \
        --json "$OUT/bench_$name.json" --plot "$OUT/bench_$name.png"
    rc=$?
    curl -s "$URL/metrics" > "$OUT/metrics_$name.txt"
    kill -TERM $server; wait $server
    echo "$name: server exit $?"
    return $rc
}

nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.csv" || true
rc=0
for name in ${RUNS:-single replicas1 replicas2}; do
    case $name in
        single) run single 0 "$@" || rc=1 ;;
        replicas1) run replicas1 1 "$@" || rc=1 ;;
        replicas2) run replicas2 2 "$@" || rc=1 ;;
        *) echo "unknown run $name"; rc=1 ;;
    esac
done
python - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import glob, json, os, sys
rows = {os.path.basename(f)[6:-5]: json.load(open(f))["rows"] for f in glob.glob(f"{sys.argv[1]}/bench_*.json")}
at = lambda n, s: next((r for r in rows.get(n, ()) if r["streams"] == s), None)
for n, rs in sorted(rows.items()):
    print(n, " ".join(f"{r['streams']}: RTF total {r['rtf_total']:.1f}, first audio p50 {r['ttfa_p50_ms']:.1f} ms, "
                      f"failures {r['failures']};" for r in rs))
top = max((r["streams"] for rs in rows.values() for r in rs), default=0)
if at("replicas1", top) and at("replicas2", top):
    print(f"aggregate RTF at {top} streams, 2 replicas / 1 replica: "
          f"{at('replicas2', top)['rtf_total'] / at('replicas1', top)['rtf_total']:.2f} (target >= 1.9)")
if at("single", 1) and at("replicas1", 1):
    print(f"first audio p50 at 1 stream, 1 replica / single process: "
          f"{at('replicas1', 1)['ttfa_p50_ms'] / at('single', 1)['ttfa_p50_ms']:.2f} (target <= 1.10)")
PY
exit $rc
