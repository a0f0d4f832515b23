#!/bin/sh
# Issue 19 in one run, on a quiet machine (the default model, 256-token prompts, 128 out):
#   1. bench/offline.py: HF generate() at batch 1 and 8, llama-cpp-python at batch 1 on the same
#      GGUF (all cores), our offline Engine on 32 requests (float32 default);
#   2. `radixserve serve` at concurrency 1, one server per mode (float32 default; --quantization
#      gguf, eager, with a float16 KV cache, and with that and --enable-torch-compile), 8
#      requests each;
#   3. `radixserve serve` with no flag at concurrency 32, 64 requests.
# Results: OUTDIR (default bench/results/cpu-issue19); the load average is printed per step.
#
#   sh bench/cpu_issue19.sh [OUTDIR]
set -u
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/cpu-issue19}
PORT=${PORT:-30979}
mkdir -p "$OUT"
. bench/experiments/serve_lib.sh

echo "=== offline, float32 (peers in the same run) $(date -u +%H:%M:%S), load $(load)"
.venv/bin/python bench/offline.py --json-out "$OUT/offline-f32.json" 2>&1 | grep -v "it/s\]" | tail -12

serve_and_measure() {  # NAME CONCURRENCY PROMPTS SERVER-FLAGS...
  name=$1; c=$2; n=$3; shift 3
  echo "=== serve $name, concurrency $c ($*) $(date -u +%H:%M:%S), load $(load)"
  start_server "$OUT/server-$name.log" "$@" || return 1
  .venv/bin/python bench/serving.py --base-url "http://127.0.0.1:$PORT" --backend native \
    --dataset random --num-prompts "$n" --input-len 256 --output-len 128 \
    --random-range-ratio 1.0 --max-concurrency "$c" --disable-tqdm \
    --json-out "$OUT/serving-$name.json" | grep -E "completed|failed|output_throughput|ttft_ms|itl_ms|tpot_ms"
  stop_server
}

serve_and_measure f32-c1 1 8
serve_and_measure gguf-c1 1 8 --quantization gguf
serve_and_measure gguf-f16kv-c1 1 8 --quantization gguf --kv-cache-dtype float16
serve_and_measure gguf-f16kv-compile-c1 1 8 --quantization gguf --kv-cache-dtype float16 \
  --enable-torch-compile
serve_and_measure default-c32 32 64
echo "=== end $(date -u +%H:%M:%S), load $(load)"
