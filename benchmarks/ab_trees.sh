#!/usr/bin/env bash
# Compare two trees of this repository with `benchmarks/gpu_serve.sh` on one GPU machine, one server after the
# other, alternating: the working tree ("new") and an older commit ("base").
#
# Here, before the GPU call:   bash benchmarks/ab_trees.sh prepare <commit>
#   extracts <commit> into ab_base/ (git-ignored through .git/info/exclude) with a `chattts-velocity` launcher
#   that runs that tree's package; carry "ab_base" (and ".whl") to the GPU machine.
# On the GPU machine:          ROUNDS=2 STREAMS="1 64 256" bash benchmarks/ab_trees.sh run
#   writes $OUT/{new,base}<round>/ and prints each level's table row; SERVE_ARGS: more `serve` arguments for
#   both (e.g. "--min-new-token 500").
#
# The launcher runs `python3 -P -m chattts_velocity.cli` with ab_base first on PYTHONPATH. Without -P, `-m`
# puts the current directory (the working tree's root, where gpu_serve.sh runs) first on sys.path, so the
# "base" server silently ran the working tree's package: an A/B of a tree against itself.
set -eu
case "${1:-}" in
prepare)
    commit=${2:?usage: bash benchmarks/ab_trees.sh prepare <commit>}
    rm -rf ab_base && mkdir -p ab_base/bin .git/info
    git archive "$commit" chattts_velocity benchmarks pyproject.toml | tar -x -C ab_base
    cat > ab_base/bin/chattts-velocity << 'EOF'
#!/bin/sh
D=$(cd "$(dirname "$0")/.." && pwd)
PYTHONPATH="$D:${PYTHONPATH:-}" exec python3 -P -m chattts_velocity.cli "$@"
EOF
    chmod +x ab_base/bin/chattts-velocity
    grep -qx "ab_base/" .git/info/exclude 2> /dev/null || echo "ab_base/" >> .git/info/exclude
    echo "ab_base/ holds $(git rev-parse --short "$commit")"
    ;;
run)
    OUT=${OUT:-/tmp/out}
    loaded=$(PYTHONPATH="$PWD/ab_base:${PYTHONPATH:-}" python3 -P -c "import chattts_velocity; print(chattts_velocity.__file__)")
    case "$loaded" in "$PWD/ab_base/"*) ;; *) echo "ab_base does not load its own package ($loaded)"; exit 1 ;; esac
    for round in $(seq 1 "${ROUNDS:-1}"); do
        for v in new base; do
            path=$PATH
            [ "$v" = base ] && path=$PWD/ab_base/bin:$PATH
            mkdir -p "$OUT/$v$round"
            echo "=== $v, round $round ($(date +%T))"
            # shellcheck disable=SC2086
            PATH=$path OUT=$OUT/$v$round PORT=$((8200 + round)) bash benchmarks/gpu_serve.sh ${SERVE_ARGS:-} 2>&1 \
                | grep "^| [0-9]" || true
        done
    done
    ;;
*)
    echo "usage: bash benchmarks/ab_trees.sh prepare <commit> | run"
    exit 2
    ;;
esac
