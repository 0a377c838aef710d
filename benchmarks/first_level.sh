# On the GPU machine: where the first 64-stream level after start-up spends its time (py-spy of every
# thread, idle ones too, during the level), then the same level again. Usage: bash benchmarks/first_level.sh
OUTD=$OUT; PORT=8401
setsid chattts-velocity serve --dummy --port $PORT --max-concurrent 256 --max-queue 512 --max-new-token 500 --log-level warning > $OUTD/server.log 2>&1 &
SERVER=$!
for i in $(seq 1 200); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; sleep 1; done
echo healthy $SECONDS
chattts-velocity bench serve --url http://127.0.0.1:$PORT --streams 64 --requests-per-stream 1 --json $OUTD/b1.json > $OUTD/b1.txt 2>&1 &
B=$!
sleep 0.5
py-spy record --threads --idle -r 100 -d 6 -f raw -o $OUTD/first.txt --pid $SERVER > /dev/null 2>&1
wait $B; grep "^| [0-9]" $OUTD/b1.txt
chattts-velocity bench serve --url http://127.0.0.1:$PORT --streams 64 --requests-per-stream 1 --json $OUTD/b2.json 2>&1 | grep "^| [0-9]"
kill -TERM $SERVER; wait $SERVER
