#!/usr/bin/env bash
# Pack the TVM stack for a lent GPU machine into .gpu/ (ignored; carried by the `device` tool,
# which moves at most 64 MiB with the working tree). That machine runs Python 3.12 with torch,
# safetensors, psutil, cloudpickle, tqdm and filelock, but has no TVM and no network.
#   libtvm_compiler.so: 259 MB; xz with the x86 filter: 58 MB (the wheel's zip: 100 MB)
#   everything else (tvm without cutlass/web/src, tvm_ffi): 3.6 MB; xgboost-cpu (tuning only): 3 MB
# Then: device run `bash .ci/gpu_check.sh all`, carry [".gpu"]. With the working tree that is
# just over the tool's 64 MiB: leave .gpu/xgboost.tar.xz out of `carry` unless tuning, and carry
# it alone in a later call on the same warm machine (gpu_check.sh unpacks it then).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$work/wheels" \
    apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post0 xgboost-cpu==3.2.0
mkdir -p "$work/site" .gpu
for w in "$work"/wheels/*.whl; do unzip -q -o "$w" -d "$work/site"; done
cd "$work/site"
rm -rf tvm/3rdparty/cutlass tvm/web tvm/src tvm_ffi/3rdparty/libbacktrace
strip --strip-unneeded xgboost/lib/libxgboost.so tvm/lib/libtvm_runtime_cuda.so
xz --x86 --lzma2=preset=9e -T1 -c tvm/lib/libtvm_compiler.so > "$OLDPWD/.gpu/libtvm_compiler.so.xz"
xz -9 -c tvm_ffi/lib/libtvm_ffi_testing.so > "$OLDPWD/.gpu/libtvm_ffi_testing.so.xz"
xgb="xgboost xgboost_cpu-*.dist-info xgboost_cpu.libs"
# shellcheck disable=SC2086  # $xgb is a list of globs
tar cf - $xgb | xz --x86 --lzma2=preset=9e -T1 > "$OLDPWD/.gpu/xgboost.tar.xz"
tar cf - --exclude=tvm/lib/libtvm_compiler.so --exclude=tvm_ffi/lib/libtvm_ffi_testing.so \
    --exclude='xgboost*' . | xz --x86 --lzma2=preset=9e -T1 > "$OLDPWD/.gpu/site_rest.tar.xz"
cd "$OLDPWD"
du -b .gpu/* && echo "add /.gpu/ to .git/info/exclude if it is not there"
