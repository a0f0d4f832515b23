#!/bin/sh
# Issue 24, CPU half: `radixserve serve` (the default model) with today's scheduling
# (--prefill-shrink-after-decodes 0, "old") against the CPU default (no flag, "new"), one server
# per run, alternating, each measured by bench/serving.py at concurrency 32 (the workload of
# bench/HISTORY.md "CPU serving, chunk size and inter-token latency"). Run it on a quiet
# machine; the load average is printed before and after each run. Mode "t2" is the default
# with the server's engine on two torch threads (--cpu-threads 2; issue 19's thread count);
# mode "sN" passes --prefill-shrink-after-decodes N. WORKLOAD=issue19 runs issue 19's
# concurrency-32 case instead (bench/cpu_issue19.sh: 64 x 256 -> 128, all sent at once).
#
#   sh bench/cpu_prefill_shrink.sh [OUTDIR] [ORDER]     # ORDER default: "old new old new"
#   WORKLOAD=issue19 sh bench/cpu_prefill_shrink.sh bench/results/cpu-shrink-c32 "s2 s1 s2 s1"
set -u
cd "$(dirname "$0")/.."
OUTDIR=${1:-bench/results/cpu-prefill-shrink}
ORDER=${2:-old new old new}
PORT=${PORT:-30977}
mkdir -p "$OUTDIR"
. bench/experiments/serve_lib.sh
n=0
for mode in $ORDER; do
  n=$((n + 1))
  flags=""
  [ "$mode" = old ] && flags="--prefill-shrink-after-decodes 0"
  [ "$mode" = t2 ] && flags="--cpu-threads 2"
  case $mode in s[0-9]*) flags="--prefill-shrink-after-decodes ${mode#s}" ;; esac
  echo "=== run $n: $mode ($flags) $(date -u +%H:%M:%S), load $(load)"
  # shellcheck disable=SC2086
  start_server "$OUTDIR/server-$n-$mode.log" $flags || exit 1
  if [ "${WORKLOAD:-}" = issue19 ]; then
    set -- --backend native --dataset random --num-prompts 64 --input-len 256 --output-len 128 \
      --random-range-ratio 1.0 --max-concurrency 32
  else
    set -- --num-prompts 96 --input-len 512 --output-len 96 --random-range-ratio 0.5 \
      --max-concurrency 32 --request-rate 4
  fi
  .venv/bin/python bench/serving.py --base-url "http://127.0.0.1:$PORT" "$@" --disable-tqdm \
    --json-out "$OUTDIR/run$n-$mode.json" |
    grep -E "completed|failed|output_throughput|ttft_ms|itl_ms|tpot_ms"
  echo "    end $(date -u +%H:%M:%S), load $(load)"
  stop_server
done
