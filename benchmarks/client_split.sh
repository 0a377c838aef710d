# On the GPU machine: one `serve --dummy`, then `bench serve` at 64 and 256 streams from different numbers of
# streams per client process (alternating): how much of the time to headers and to first audio is the load
# generator's own? Usage: SPP="16 4 16 4" STREAMS="64 256" bash benchmarks/client_split.sh  (writes $OUT/b_*.json)
OUTD=$OUT; PORT=8301
SPP=${SPP:-"64 16 64 16 4"}
STREAMS=${STREAMS:-64}
setsid chattts-velocity serve --dummy --port $PORT --max-concurrent 256 --max-queue 512 --max-new-token 500 --log-level warning > $OUTD/server.log 2>&1 &
for i in $(seq 1 200); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; sleep 1; done
echo healthy $SECONDS
run=0
for n in $STREAMS; do
  for spp in $SPP; do
    run=$((run + 1))
    chattts-velocity bench serve --url http://127.0.0.1:$PORT --streams "$n" --requests-per-stream 2 --streams-per-process "$spp" --json "$OUTD/b_${run}_${n}_$spp.json" 2>&1 | grep "^| [0-9]" | sed "s/^/spp=$spp /"
  done
done
python3 -c "
import json,glob
for f in sorted(glob.glob('$OUTD/b_*.json'), key=lambda f: int(f.split('_')[1])):
    for r in json.load(open(f))['rows']: print(f.split('/')[-1], 'headers p50/p99', round(r['headers_p50_ms'],1), round(r['headers_p99_ms'],1), 'ttfa', round(r['ttfa_p50_ms'],1), round(r['ttfa_p99_ms'],1), 'procs', r['client_processes'])
"
