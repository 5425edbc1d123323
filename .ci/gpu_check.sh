#!/usr/bin/env bash
# The CUDA checks, on a lent GPU machine (the `device` tool; CI has no GPU). That machine has
# Python 3.12 with torch but no TVM and no network, so the TVM stack travels in .gpu/ (made here
# by .ci/gpu_bundle.sh, carried with `carry: [".gpu"]`), unpacked to /tmp/site.
#   .ci/gpu_check.sh [tests|profile|bench|all]      logs go to $OUT (or /tmp/gpu_out)
# Time limits and the benchmark's rows: TESTS_S, PROFILE_S, BENCH_S (seconds), CASES, MODES,
# ENGINES, BENCH_ARGS (more benchmarks.run flags), PROFILE_CASES; PYTEST_ARGS
# picks tests (split on spaces, so no quoted words: "-k float16", "-k (llama)or(seq2seq)",
# "--deselect=tests/gpu/..."; tests/gpu/test_cuda_zoo.py alone takes about 3 minutes).
# A file .gpu/amp_probe.py, if any, is a one-off probe run between the two.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
what=${1:-all}
if [ ! -e /tmp/site/tvm/lib/libtvm_compiler.so ]; then
    mkdir -p /tmp/site && tar xJf .gpu/site_rest.tar.xz -C /tmp/site \
        && xz -dc .gpu/libtvm_compiler.so.xz > /tmp/site/tvm/lib/libtvm_compiler.so || exit 1
fi
if [ ! -e /tmp/site/tvm_ffi/lib/libtvm_ffi_testing.so ]; then  # tvm_ffi's core links it
    xz -dc .gpu/libtvm_ffi_testing.so.xz > /tmp/site/tvm_ffi/lib/libtvm_ffi_testing.so || exit 1
fi
if [ -e .gpu/xgboost.tar.xz ] && [ ! -e /tmp/site/xgboost ]; then  # tuning's cost model
    tar xJf .gpu/xgboost.tar.xz -C /tmp/site || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TVMGRAPH_CACHE_DIR=/tmp/tvmgraph-cache
export CUDA_PATH=${CUDA_PATH:-$(dirname "$(dirname "$(command -v nvcc)")")}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, numpy, tvm; print('torch', torch.__version__, 'numpy', numpy.__version__, 'tvm', tvm.__version__)" \
    | tee -a "$OUT/machine.txt"
# NVRTC (TVM's default) needs CUDA_PATH's headers; fall back to nvcc when it cannot compile.
if ! python3 .ci/gpu_smoke.py >"$OUT/nvrtc.txt" 2>&1
then
    echo "NVRTC failed (see nvrtc.txt); using nvcc" | tee -a "$OUT/machine.txt"
    export TVM_CUDA_COMPILE_MODE=nvcc
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
    timeout ${TESTS_S:-240} python3 -m pytest tests/gpu ${PYTEST_ARGS:-} -v -p no:cacheprovider -s -W default --durations=0 2>&1 | tee "$OUT/gpu_tests.log"
fi
if [ -e .gpu/amp_probe.py ]; then  # a one-off probe carried with the bundle
    timeout 60 python3 .gpu/amp_probe.py 2>&1 | grep -v DEBUG | tee "$OUT/probe.log"
fi
if [ "$what" = profile ] || [ "$what" = all ]; then  # where the untuned training steps' time goes
    timeout ${PROFILE_S:-120} python3 -m benchmarks.profile --device cuda --cases ${PROFILE_CASES:-cnn,resnet18} \
        --modes train --top 12 2>&1 | grep -v DEBUG | tee "$OUT/gpu_profile.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    timeout ${BENCH_S:-150} python3 -m benchmarks.run --device cuda --cases ${CASES:-mlp_b64,cnn,resnet18} \
        --modes ${MODES:-infer,train} --engines ${ENGINES:-eager,tvmgraph,compile} --rounds 5 --seconds 0.1 \
        --no-memory ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/gpu_bench.log"
fi
