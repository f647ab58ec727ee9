#!/bin/bash
# One `oxserve bench serve` run per setting of server options, servers restarted between runs.
#   docs/bench/serve_sweep.sh OUTDIR ROUNDS "--max-stall 0" "--max-stall 4" ...
# Workload: NUM (32) random requests of 512 prompt and 96 output tokens at RATE (1.0) req/s,
# a DTYPE (float32) server; e.g. DTYPE=bfloat16 RATE=6 NUM=96 docs/bench/serve_sweep.sh ...
# Writes OUTDIR/r<round>_a<arm>.json (bench serve --json) and the server logs.
set -u
out=$1; rounds=$2; shift 2
dtype=${DTYPE:-float32}; rate=${RATE:-1.0}; num=${NUM:-32}
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  i=0
  for arm in "$@"; do
    i=$((i + 1)); port=$((8100 + i))
    # shellcheck disable=SC2086  # each arm is a list of options
    oxserve serve --host 127.0.0.1 --port $port --dtype "$dtype" $arm > "$out/server_r${r}_a$i.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 120); do curl -s "http://127.0.0.1:$port/v1/models" > /dev/null && break; sleep 1; done
    oxserve bench serve --base-url "http://127.0.0.1:$port" --num-prompts "$num" --random-input-len 512 \
      --random-output-len 96 --request-rate "$rate" --seed "$r" --json --disable-tqdm \
      > "$out/r${r}_a$i.json" 2> "$out/r${r}_a$i.err"
    kill $pid; wait $pid 2> /dev/null
    echo "round $r arm $i ($arm): $(tail -n 1 "$out/r${r}_a$i.json" | python3 -c 'import json, sys; d = json.load(sys.stdin); print("%.1f tok/s, ITL median %.0f ms, p99 %.0f ms" % (d["output_throughput"], d["median_itl_ms"], d["p99_itl_ms"]))')"
  done
done
