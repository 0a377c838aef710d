#!/usr/bin/env bash
# On the GPU machine: start `chattts-velocity serve --dummy` in the background, wait until healthy, drive it with
# `chattts-velocity bench serve` at 1/8/64/256 streams, then save the server's /metrics and log under $OUT.
# Usage: bash benchmarks/gpu_serve.sh [extra serve args...]
# PROFILE=<streams>: also sample the server's threads with py-spy at that level (PYSPY_ARGS, e.g. "--threads --idle
# --native -r 100 -d 5", to see where a thread waits)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PORT=${PORT:-8011}
STREAMS=${STREAMS:-"1 8 64 256"}
MAX_NEW=${MAX_NEW:-500}
setsid chattts-velocity serve --dummy --port "$PORT" --max-concurrent 256 --max-queue 512 \
    --max-new-token "$MAX_NEW" --log-level warning "$@" > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $SERVER 2> /dev/null || { echo "server died"; tail -40 "$OUT/server.log"; exit 1; }
    sleep 1
done
echo "server healthy after ${SECONDS}s"
# shellcheck disable=SC2086
chattts-velocity bench serve --url "http://127.0.0.1:$PORT" --streams $STREAMS --requests-per-stream 2 \
    --json "$OUT/bench_serve.json" --plot "$OUT/bench_serve.png"
rc=$?
if [ -n "${PROFILE:-}" ]; then  # where the server's CPU goes at $PROFILE streams: samples of running threads
    chattts-velocity bench serve --url "http://127.0.0.1:$PORT" --streams "$PROFILE" --requests-per-stream "${PROFILE_REQUESTS:-4}" \
        --json "$OUT/bench_serve_profiled.json" > "$OUT/profiled.txt" 2>&1 &
    BENCH=$!
    sleep "${PROFILE_DELAY:-3}"  # the client processes start (spawned, importing torch) before the level
    # shellcheck disable=SC2086
    py-spy record ${PYSPY_ARGS:---threads -r 200 -d 8} -f raw -o "$OUT/cpu.txt" --pid $SERVER > /dev/null 2>&1
    py-spy dump --pid $SERVER > "$OUT/dump.txt" 2>&1
    wait $BENCH
fi
curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics.txt"
kill -TERM $SERVER; wait $SERVER
echo "server exit $?"
tail -20 "$OUT/server.log"
exit $rc
