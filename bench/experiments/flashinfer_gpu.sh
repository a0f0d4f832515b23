#!/bin/bash
# The flashinfer attention plugin on the lent GPU (issue 18). Run in the repository root with
# `.whl` and `.whl-fi` carried (and `.fi-cache` when an earlier call brought its JIT cache back):
#   bash bench/flashinfer_gpu.sh smoke          # import, JIT, layer tests, engines vs triton
#   bash bench/flashinfer_gpu.sh fitests        # the flashinfer GPU tests (+ bf16 reuse traffic)
#   bash bench/flashinfer_gpu.sh tests          # every attention/hardware test but CPU-only ones
#   bash bench/flashinfer_gpu.sh "bench ARGS"   # bench/gpu.py --attention triton,flashinfer ARGS
# Each phase runs under `timeout` and prints a PASS/FAIL line. FlashInfer compiles its kernels on
# first use (JIT); the compiled modules go back as $OUT/fi-cache.tar.gz.partNN (unless
# FI_NO_CACHE=1), which, joined into .fi-cache/fi-cache.tar.gz and carried, saves the next call
# that time.
OUT=${OUT:-/tmp/out}
LOGS=/tmp/fi-logs-$$  # the set-up's logs stay on the machine (at most 8 files come back)
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp/fiws
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
phase() {  # phase NAME SECONDS COMMAND...: run one phase, say how it went (log: $LOGS/NAME.log)
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$LOGS/$name.log"
    if [ $rc -eq 0 ]; then echo "PASS $name ($((SECONDS - start)) s)"; else
        echo "FAIL $name rc=$rc ($((SECONDS - start)) s)"; fi
    return $rc
}
setup() {  # once per machine: a second run (on another GPU) finds it done
    [ -f /tmp/fi/.done ] && return 0
    python3 tools/install_wheels.py .whl /tmp/site >/dev/null &&
        python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/fi .whl-fi/*.whl &&
        python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 &&
        mkdir -p /tmp/fiws && if [ -f .fi-cache/fi-cache.tar.gz ]; then
            tar -C /tmp/fiws -xzf .fi-cache/fi-cache.tar.gz &&
                # newer than the freshly installed sources, so ninja finds nothing to rebuild
                find /tmp/fiws -exec touch {} + && echo "JIT cache unpacked"; fi &&
        touch /tmp/fi/.done
}
export PYTHONPATH=/tmp/fi:/tmp/site
exec 9>/tmp/fi-setup.lock
flock 9 && setup >"$LOGS/setup.log" 2>&1 || { tail "$LOGS/setup.log"; echo "FAIL setup"; exit 1; }
echo "PASS setup ($SECONDS s)"
flock -u 9
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
phase import 120 python3 -c "
import flashinfer, torch
from radixserve.plugins.attention import flashinfer as p
print('flashinfer', flashinfer.__version__, 'unavailable_reason:', p.unavailable_reason())
assert p.unavailable_reason() is None"
LOGS=$OUT  # the work's logs come back
FI_TEST=tests/plugins/attention/test_flashinfer_backend.py
for job in "$@"; do
    case "$job" in
    smoke)
        phase layer 240 python3 -m pytest -q -x -s -p no:cacheprovider "$FI_TEST" \
            -k "layer_matches or cuda_graph or page or unavailable or selecting"
        phase engines 300 python3 -m pytest -q -x -s -p no:cacheprovider "$FI_TEST" -k engine
        ;;
    fitests)  # the flashinfer GPU tests: layers, graphs, engines vs triton, bf16 reuse traffic
        phase fitests 420 python3 -m pytest -q -s -p no:cacheprovider -m gpu "$FI_TEST" \
            tests/plugins/attention/test_reuse_traffic.py -k "flashinfer_backend or bf16"
        ;;
    tests)  # every attention/hardware test but the CPU-only files (TESTS_LIMIT s at most)
        phase tests "${TESTS_LIMIT:-590}" python3 -m pytest -q -p no:cacheprovider \
            tests/plugins/attention tests/plugins/hardware \
            --ignore=tests/plugins/attention/test_cpu_paged.py \
            --ignore=tests/plugins/hardware/test_cpu_compile.py \
            --ignore=tests/plugins/hardware/test_cpu_fused_ops.py \
            --ignore=tests/plugins/hardware/test_cpu_linear.py \
            --ignore=tests/plugins/hardware/test_cpu_platform.py
        ;;
    bench*)
        phase bench 540 python3 bench/gpu.py --attention triton,flashinfer \
            --json-out "$OUT/gpu-fi.json" ${job#bench}
        ;;
    esac
done
[ -n "$FI_NO_CACHE" ] && exit 0  # FI_NO_CACHE=1: do not send the JIT cache back
tar -C /tmp/fiws -czf /tmp/fi-cache-$$.tar.gz . && ls -la /tmp/fi-cache-$$.tar.gz
# One file back is at most 16 MiB: larger caches come back in parts (cat them together).
split -b 15M -d /tmp/fi-cache-$$.tar.gz "$OUT/fi-cache.tar.gz.part"
