#!/usr/bin/env bash
# On the GPU machine: the speech server in one process and with the engine in a process of its own
# (`serve --engine-process`), one after the other on the same machine, each driven by `bench serve`
# (`benchmarks/gpu_serve.sh`); results under $OUT/<variant>/.
# Usage: VARIANTS="one split" STREAMS="1 64 256" bash benchmarks/split_ab.sh [extra serve args for every variant...]
# Variants: one (one process), split (--engine-process), one-fixed / split-fixed (also --min-new-token
# $MAX_NEW: every request's audio as long, the random weights' early ends masked).
set -u
OUT=${OUT:-/tmp/out}
MAX_NEW=${MAX_NEW:-500}
export STREAMS=${STREAMS:-"1 64 256"} MAX_NEW
rc=0
for v in ${VARIANTS:-one split}; do
    case $v in
        one) args=() ;;
        split) args=(--engine-process) ;;
        one-fixed) args=(--min-new-token "$MAX_NEW") ;;
        split-fixed) args=(--engine-process --min-new-token "$MAX_NEW") ;;
        *) echo "unknown variant $v"; exit 2 ;;
    esac
    echo "=== $v: ${args[*]} $*"
    OUT="$OUT/$v" PORT=$((8011 + RANDOM % 500)) bash "$(dirname "$0")/gpu_serve.sh" "${args[@]}" "$@" || rc=$?
done
exit $rc
