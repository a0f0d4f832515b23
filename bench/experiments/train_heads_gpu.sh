#!/bin/bash
# Train the EAGLE-3, EAGLE and DFlash heads for the default model on the lent H200 (issue 15;
# docs/speculative-training.md "On the GPU"). Run in the repository root, `.whl` carried:
#   bash bench/train_heads_gpu.sh stash .gp/part0    # one part of the GGUF per call (a call
#   bash bench/train_heads_gpu.sh stash .gp/part1    #   carries 64 MiB; the machine stays warm)
#   bash bench/train_heads_gpu.sh join SHA256 data eagle3 eagle dflash
#   bash bench/train_heads_gpu.sh smoke DATA_DIR      # the CUDA path on random SmolLM2 weights
# The heads come back as $OUT/<algorithm>/ (config.json, model.safetensors), the held-out
# records as $OUT/heldout.jsonl (the local CPU evaluation reads them), logs as $OUT/*.log.
OUT=${OUT:-/tmp/out}
WORK=/tmp/heads/work
GGUF=/tmp/heads/smol.gguf
mkdir -p "$OUT" /tmp/heads/parts "$WORK"
export PYTHONUNBUFFERED=1
if [ ! -f /tmp/heads/.setup ]; then
    python3 tools/install_wheels.py .whl /tmp/site >/dev/null &&
        python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 &&
        touch /tmp/heads/.setup || echo "set-up failed"
fi
export PYTHONPATH=/tmp/site
# The GPU recipe's data and training flags (one place: the docs quote this script).
DATA_FLAGS="--prompt-set large --prompts-per-workload 600 --samples-per-prompt 4 \
    --max-new-tokens 256 --gen-batch 512 --engine-dtype bfloat16"
TRAIN_FLAGS="--device cuda --dtype bfloat16 --max-len 640 --capture-tokens 32768 --batch 32"
phase() {  # phase NAME SECONDS COMMAND...: run one phase with its log in $OUT
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    grep -v "it/s\]\|s/it\]" "$OUT/$name.log" | tail -n 12
    if [ $rc -eq 0 ]; then echo "PASS $name ($((SECONDS - start)) s)"; else
        echo "FAIL $name rc=$rc ($((SECONDS - start)) s)"; fi
    return $rc
}
while [ $# -gt 0 ]; do
    job=$1
    shift
    case "$job" in
    stash)  # stash PART: keep one carried part of the GGUF on the machine
        cp "$1" /tmp/heads/parts/ && ls -la /tmp/heads/parts
        shift ;;
    join)  # join SHA256: the parts, in name order, checked
        cat /tmp/heads/parts/* >"$GGUF"
        echo "$1  $GGUF" | sha256sum -c - || exit 1
        shift ;;
    smoke)  # smoke DATA_DIR: capture + training on CUDA, random weights, tiny data
        python3 -c "from pathlib import Path; import sys; sys.path.insert(0, 'bench')
from gpu_model import write_random_llama; write_random_llama(Path('/tmp/heads/rand'), 'smollm2', 'cuda')"
        cp "$1"/data.jsonl "$WORK"/
        phase smoke-eagle3 150 python3 tools/train_draft.py --model /tmp/heads/rand --tiny \
            --out /tmp/heads/s3 --work "$WORK" --phases train $TRAIN_FLAGS --ttt 5
        phase smoke-eagle 120 python3 tools/train_draft.py --model /tmp/heads/rand --tiny \
            --algorithm eagle --out /tmp/heads/s1 --work "$WORK" --phases train $TRAIN_FLAGS
        phase smoke-dflash 90 python3 tools/train_dflash.py --model /tmp/heads/rand \
            --out /tmp/heads/sd --work "$WORK" --phases train --device cuda --dtype bfloat16 \
            --eagle-capture "$WORK/capture-eagle.pt" --steps 10
        rm -f "$WORK"/*
        shift ;;
    data)
        phase data 420 python3 tools/train_draft.py --model "$GGUF" --out "$OUT/eagle3" \
            --work "$WORK" --phases data $DATA_FLAGS
        python3 -c "import json, sys
rows = [json.loads(l) for l in open('$WORK/data.jsonl')]
held = [r for r in rows if r['split'] == 'heldout' and r['greedy']]
open('$OUT/heldout.jsonl', 'w').writelines(json.dumps(r) + '\n' for r in held)
n = sum(len(r['prompt_ids']) + len(r['answer_ids']) for r in rows if r['split'] == 'train')
print(f'{len(rows)} records, {len(held)} held-out greedy, {n} training tokens')" ;;
    eagle3)
        phase eagle3 540 python3 tools/train_draft.py --model "$GGUF" --out "$OUT/eagle3" \
            --work "$WORK" --phases train $TRAIN_FLAGS --ttt 5 --steps 3000 --lr 6e-4 \
            --max-train-seconds ${EAGLE3_SECONDS:-300} ;;
    eagle)
        phase eagle 540 python3 tools/train_draft.py --model "$GGUF" --out "$OUT/eagle" \
            --algorithm eagle --work "$WORK" --phases train $TRAIN_FLAGS --ttt 5 --steps 3000 \
            --lr 6e-4 --max-train-seconds ${EAGLE_SECONDS:-240} ;;
    dflash)
        phase dflash 540 python3 tools/train_dflash.py --model "$GGUF" --out "$OUT/dflash" \
            --work "$WORK" --phases train --device cuda --dtype bfloat16 --eagle-capture "$WORK/capture-eagle.pt" \
            --block-size 5 --max-len 640 --batch 32 --steps 3000 --lr 6e-4 \
            --max-train-seconds ${DFLASH_SECONDS:-180} ;;
    *) echo "unknown job $job"; exit 2 ;;
    esac
done
