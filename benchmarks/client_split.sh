# On the GPU machine: one `serve --dummy`, then `bench serve` at 64 streams from 1, 4 and 16 client processes
# (alternating) and 256 streams from 16: does the client process skew time to headers and first audio?
# Usage: bash benchmarks/client_split.sh  (writes $OUT/b_*.json)
OUTD=$OUT; PORT=8301
setsid chattts-velocity serve --dummy --port $PORT --max-concurrent 256 --max-queue 512 --max-new-token 500 --log-level warning > $OUTD/server.log 2>&1 &
for i in $(seq 1 200); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; sleep 1; done
echo healthy $SECONDS
for spp in 64 16 64 16 4; do
  chattts-velocity bench serve --url http://127.0.0.1:$PORT --streams 64 --requests-per-stream 2 --streams-per-process $spp --json $OUTD/b_$spp.json 2>&1 | grep "^| [0-9]" | sed "s/^/spp=$spp /"
done
chattts-velocity bench serve --url http://127.0.0.1:$PORT --streams 256 --requests-per-stream 2 --streams-per-process 16 --json $OUTD/b256.json 2>&1 | grep "^| [0-9]" | sed "s/^/spp=16 /"
python3 -c "
import json,glob
for f in sorted(glob.glob('$OUTD/b*.json')):
    for r in json.load(open(f))['rows']: print(f.split('/')[-1], 'headers p50/p99', round(r['headers_p50_ms'],1), round(r['headers_p99_ms'],1), 'ttfa', round(r['ttfa_p50_ms'],1), round(r['ttfa_p99_ms'],1), 'procs', r['client_processes'])
"
