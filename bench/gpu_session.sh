#!/bin/sh
# One call on the lent GPU machine (see docs/BENCHMARKS.md): make this checkout importable as
# `radixserve`, install the wheels carried in .whl/ that the device image lacks (gguf, the
# serving stack; bench/install_wheels.py: none over the image's torch stack), run the GPU
# tests at real sizes, then the benchmarks given as arguments, e.g.
#   sh bench/gpu_session.sh tests "llama3-8b" "smollm2 --skip-big"
#   sh bench/gpu_session.sh tp              # on nvidia-h200-x2: bench/tp.py
#   sh bench/gpu_session.sh moe-tests models  # issue 20: fused MoE tests, bench/models.py
#   sh bench/gpu_session.sh "spec --batches 1 8 --accept 3.5 2.5" spec-tests spec-profile
# Results go to $OUT (gpu-<shape>.json, tp.json, models.json, spec.json, spec-profile.txt,
# tests.log, moe-tests.log, spec-tests.log).
set -e
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/pkg
python3 bench/install_wheels.py .whl /tmp/site
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# An editable install registers the built-in plugins' entry points and the `radixserve` script.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
    || { ln -sfn "$PWD" /tmp/pkg/radixserve; export PYTHONPATH=/tmp/pkg:/tmp/site;
         echo "editable install failed: entry-point plugins (tests) will be missing"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for job in "$@"; do
    if [ "$job" = tests ]; then
        python3 -m pytest -q -p no:cacheprovider tests/plugins/attention tests/plugins/hardware \
            2>&1 | tee "$OUT/tests.log" | tail -25
        continue
    fi
    if [ "$job" = moe-tests ]; then  # the fused MoE kernels compiled, at Qwen3-30B-A3B's shapes
        python3 -m pytest -q -p no:cacheprovider tests/plugins/models/test_fused_moe.py \
            2>&1 | tee "$OUT/moe-tests.log" | tail -15
        continue
    fi
    if [ "${job%% *}" = models ]; then  # "models [flags]": bench/models.py (issue 20's shapes)
        python3 bench/models.py --json-out "$OUT/models.json" ${job#models} \
            2>&1 | grep -v "it/s\]" | tail -40
        continue
    fi
    if [ "$job" = spec-tests ]; then  # issue 14: speculation with Triton + CUDA graphs
        python3 -m pytest -q -p no:cacheprovider tests/plugins/hardware/test_cuda_speculative.py \
            2>&1 | tee "$OUT/spec-tests.log" | tail -15
        continue
    fi
    if [ "$job" = spec-profile ]; then  # after "spec": where a batch-1 step's time goes
        python3 bench/spec_profile.py /tmp/models/llama3-8b /tmp/models/llama3-8b-draft-1layer \
            > "$OUT/spec-profile.txt" 2>&1 || echo "spec_profile failed (see spec-profile.txt)"
        grep "steps, " "$OUT/spec-profile.txt" || true
        continue
    fi
    if [ "${job%% *}" = spec ]; then  # "spec [flags]": bench/speculative.py gpu
        python3 bench/speculative.py gpu --json-out "$OUT/spec.json" ${job#spec} \
            2>&1 | grep -v "it/s\]" | tail -30
        continue
    fi
    if [ "${job%% *}" = tp ]; then  # "tp [flags]": bench/tp.py, TP1 against TP2 (2 GPUs)
        python3 bench/tp.py --json-out "$OUT/tp.json" --workdir /tmp/models ${job#tp} \
            2>&1 | grep -v "it/s\]" | tail -40
        continue
    fi
    set -- $job
    shape=$1; shift
    python3 bench/gpu.py --shape "$shape" --json-out "$OUT/gpu-$shape.json" "$@" \
        --workdir /tmp/models 2>&1 | grep -v "it/s\]" | tail -60
done
