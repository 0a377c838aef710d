#!/usr/bin/env bash
# On the GPU machine: the speech server's first audio at 1 and 8 streams under different GIL switch intervals
# (sys.setswitchinterval, seconds; "default" = Python's 0.005). A chunk crosses three threads on its way out
# (engine thread -> request thread -> event loop), and each hand-off may wait for the holder's interval.
# Usage: bash benchmarks/serve_switch.sh default 0.0005   (STREAMS="64 256" REQUESTS=2 for the loaded levels)
set -u
PORT=${PORT:-8012}
STREAMS=${STREAMS:-"1 8"}
REQUESTS=${REQUESTS:-4}
for si in "$@"; do
    python3 - serve --dummy --port "$PORT" --max-concurrent 256 --max-queue 512 --max-new-token 500 --log-level warning \
        > "/tmp/serve_switch_$si.log" 2>&1 <<PY &
import sys
if "$si" != "default":
    sys.setswitchinterval(float("$si"))
from chattts_velocity.cli import main
sys.exit(main(sys.argv[1:]))
PY
    server=$!
    for _ in $(seq 1 200); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
    echo "== switch interval $si"
    # shellcheck disable=SC2086
    chattts-velocity bench serve --url "http://127.0.0.1:$PORT" --streams $STREAMS --requests-per-stream "$REQUESTS" \
        | grep '^|'
    kill -TERM $server; wait $server
done
