#!/usr/bin/env bash
# On the GPU machine: the speech server in one process and with the engine in a process of its own
# (`serve --engine-process`), one after the other on the same machine, each driven by `bench serve`
# (`benchmarks/gpu_serve.sh`); results under $OUT/<n>_<label>/.
# Usage: VARIANTS="one split" STREAMS="1 64 256" bash benchmarks/split_ab.sh [extra serve args for every variant...]
# Variants: one (one process), split (--engine-process), one-fixed / split-fixed (also --min-new-token
# $MAX_NEW: every request's audio as long, the random weights' early ends masked), or LABEL@ARGS: serve
# arguments separated by commas (e.g. round100@--min-new-token,500,--audio-round-ms,100), where
# ENV=NAME=VALUE arguments set environment variables of that server only, e.g.
# si1@ENV=CHATTTS_SWITCH_INTERVAL_MS=1 with benchmarks/switch_interval on PYTHONPATH; the README's newest table
# ran f4fix@--fronts,4,--min-new-token,500 and f4@--fronts,4 beside one-fixed and one. A variant may
# come more than once (alternating runs): each run's results go under $OUT/<n>_<label>/, and a summary line per
# level is printed.
set -u
OUT=${OUT:-/tmp/out}
MAX_NEW=${MAX_NEW:-500}
export STREAMS=${STREAMS:-"1 64 256"} MAX_NEW
rc=0 n=0
for v in ${VARIANTS:-one split}; do
    label=$v
    case $v in
        one) args=() ;;
        split) args=(--engine-process) ;;
        one-fixed) args=(--min-new-token "$MAX_NEW") ;;
        split-fixed) args=(--engine-process --min-new-token "$MAX_NEW") ;;
        *@*) label=${v%%@*}; IFS=, read -r -a args <<< "${v#*@}" ;;
        *) echo "unknown variant $v"; exit 2 ;;
    esac
    envs=() rest=()
    for a in "${args[@]}"; do
        case $a in ENV=*) envs+=("${a#ENV=}") ;; *) rest+=("$a") ;; esac
    done
    args=("${rest[@]}")
    n=$((n + 1))
    dir="$OUT/${n}_$label"
    echo "=== $n $label: ${envs[*]} ${args[*]} $*"
    env "${envs[@]}" OUT="$dir" PORT=$((8011 + RANDOM % 500)) bash "$(dirname "$0")/gpu_serve.sh" "${args[@]}" "$@" || rc=$?
    python3 - "$dir/bench_serve.json" "$n $label" <<'PY' || true
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(sys.argv[2], "streams", r["streams"], "ttfa p50/p99 %.0f/%.0f first/later p99 %s/%s headers p50/p99 %.0f/%.0f"
          " slowest %.2fx audio s/s %.0f failures %s" % (r["ttfa_p50_ms"], r["ttfa_p99_ms"], r.get("ttfa_p99_first_ms"),
          r.get("ttfa_p99_later_ms"), r["headers_p50_ms"], r["headers_p99_ms"], r["rtf_min"],
          r["rtf_total"], r["failures"]))
PY
done
exit $rc
