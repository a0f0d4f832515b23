#!/bin/sh
# Issue 19's concurrency-1 target, alternating peers: ROUNDS times (default 3), llama-cpp-python
# at batch 1 on the default GGUF (bench/offline.py, 4 requests of 256 random tokens -> 128, all
# cores), then `radixserve serve` with SERVER_FLAGS (default --quantization gguf) at concurrency 1
# over HTTP (bench/serving.py, 8 requests of the same shape). The VM's speed drifts by 20-30%
# within minutes, so each round's ratio pairs runs a minute apart; the summary prints them all.
#
#   sh bench/cpu_c1_llamacpp.sh [OUTDIR] [ROUNDS]      (SERVER_FLAGS="..." to change the mode)
set -u
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/cpu-c1-llamacpp}
ROUNDS=${2:-3}
FLAGS=${SERVER_FLAGS:---quantization gguf}
PORT=${PORT:-30983}
mkdir -p "$OUT"
. bench/experiments/serve_lib.sh

for r in $(seq "$ROUNDS"); do
  echo "=== round $r: llama-cpp-python b1 $(date -u +%H:%M:%S), load $(load)"
  .venv/bin/python bench/offline.py --num-requests 4 --skip-hf --quantization gguf \
    --json-out "$OUT/llamacpp-r$r.json" 2>&1 | grep "^llamacpp-b1 "
  echo "=== round $r: serve $FLAGS, concurrency 1 $(date -u +%H:%M:%S), load $(load)"
  # shellcheck disable=SC2086
  start_server "$OUT/server-r$r.log" $FLAGS || exit 1
  .venv/bin/python bench/serving.py --base-url "http://127.0.0.1:$PORT" --backend native \
    --dataset random --num-prompts 8 --input-len 256 --output-len 128 \
    --random-range-ratio 1.0 --max-concurrency 1 --disable-tqdm \
    --json-out "$OUT/serving-r$r.json" | grep -E "output_throughput|tpot_ms"
  stop_server
done
.venv/bin/python - "$OUT" "$ROUNDS" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for r in range(1, rounds + 1):
    peer = json.load(open(f"{out}/llamacpp-r{r}.json"))
    llama = next(x for x in peer["results"] if x["name"] == "llamacpp-b1")["tokens_per_s"]
    ours = json.load(open(f"{out}/serving-r{r}.json"))["output_throughput"]
    print(f"round {r}: serve c1 {ours:.2f} tok/s, llama-cpp-python b1 {llama:.2f}: {ours / llama:.2f}x")
PY
