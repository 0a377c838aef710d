#!/usr/bin/env bash
# On the GPU machine: why the first 64-stream level of a fresh server is sometimes slow (first audio p50
# 1.1-1.9 s instead of 0.3-0.5 s). For each of N fresh servers: levels of 1 and 8 streams, then 64 streams
# while py-spy samples every thread (idle ones too), counting the Triton kernels compiled during each level
# (new entries of the Triton cache). Usage: RUNS=3 bash benchmarks/first_level.sh  (writes $OUT/run<i>/)
set -u
OUT=${OUT:-/tmp/out}
CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
for run in $(seq 1 "${RUNS:-3}"); do
    D=$OUT/run$run; mkdir -p "$D"; PORT=$((8400 + run))
    setsid chattts-velocity serve --dummy --port $PORT --max-concurrent 256 --max-queue 512 --max-new-token 500 \
        --log-level warning > "$D/server.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 1 200); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
    ls "$CACHE" > "$D/cache0.txt" 2>/dev/null
    for n in 1 8; do
        chattts-velocity bench serve --url "http://127.0.0.1:$PORT" --streams $n --json "$D/b$n.json" 2>&1 \
            | grep "^| [0-9]" | sed "s/^/run$run /"
    done
    ls "$CACHE" > "$D/cache1.txt" 2>/dev/null
    chattts-velocity bench serve --url "http://127.0.0.1:$PORT" --streams 64 --json "$D/b64.json" > "$D/b64.txt" 2>&1 &
    B=$!
    sleep 1.5
    py-spy record --threads --idle -r 50 -d 6 -f raw -o "$D/spy.txt" --pid $SERVER > /dev/null 2>&1
    wait $B; grep "^| [0-9]" "$D/b64.txt" | sed "s/^/run$run /"
    ls "$CACHE" > "$D/cache2.txt" 2>/dev/null
    echo "run$run new Triton cache entries: after 1+8 streams $(comm -13 "$D/cache0.txt" "$D/cache1.txt" | wc -l)," \
         "after 64 $(comm -13 "$D/cache1.txt" "$D/cache2.txt" | wc -l)"
    for entry in $(comm -13 "$D/cache0.txt" "$D/cache2.txt"); do  # the kernels compiled while serving
        echo "run$run compiled while serving: $(ls "$CACHE/$entry" | grep '\.json$' | grep -v __grp__ | tr '\n' ' ')"
        for f in "$CACHE/$entry"/*.json; do case $f in *__grp__*) ;; *) head -c 700 "$f"; echo;; esac; done
    done
    curl -s "http://127.0.0.1:$PORT/metrics" > "$D/metrics.txt"
    kill -TERM $SERVER; wait $SERVER
done
