#!/usr/bin/env bash
# On the GPU machine: compare `serve` options on one machine, one server after the other. Each argument is
# "name:serve args"; each variant runs `benchmarks/gpu_serve.sh` into $OUT/name (STREAMS as gpu_serve.sh).
# Usage: STREAMS="64 256" bash benchmarks/ab_serve.sh "nocap:--max-window-tokens 0" "cap:--max-window-tokens 2048"
set -u
BASE=${OUT:-/tmp/out}
PORT=${PORT:-8100}
for v in "$@"; do
    name=${v%%:*}; args=${v#*:}
    PORT=$((PORT + 1))
    mkdir -p "$BASE/$name"
    echo "=== $name ($args) $(date +%T)"
    # shellcheck disable=SC2086
    OUT=$BASE/$name PORT=$PORT bash benchmarks/gpu_serve.sh $args > "$BASE/$name/run.txt" 2>&1
    grep -B2 -A6 "first audio" "$BASE/$name/run.txt" | head -14
done
