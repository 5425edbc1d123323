#!/usr/bin/env bash
# Run a saved aarch64 graph on this x86-64 Debian machine under qemu-user (no binfmt, no root
# beyond what apt-get download needs): prepares, once, in $TVMGRAPH_TEST_EMU_DIR (default
# ~/.cache/tvmgraph/aarch64-emu):
#   qemu/    Debian's qemu-user-static, unpacked (dpkg -x)
#   root/    an arm64 Python 3.11 from Debian's arm64 packages, unpacked
#   site/    the aarch64 manylinux wheels of apache-tvm, apache-tvm-ffi, numpy, safetensors
# then runs:  scripts/aarch64_emulation.sh run SAVED_DIR INPUT.npy OUTPUT.npy
#   (TVM_USE_RUNTIME_LIB=1; tvmgraph from this checkout; output written with numpy).
# `scripts/aarch64_emulation.sh prepare` only prepares. Timings under emulation mean nothing.
set -euo pipefail

EMU="${TVMGRAPH_TEST_EMU_DIR:-$HOME/.cache/tvmgraph/aarch64-emu}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
# The Debian packages that make an arm64 python3.11 with the shared libraries TVM links to.
PACKAGES="python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libgcc-s1 libstdc++6
  zlib1g libexpat1 libffi8 libssl3 libbz2-1.0 liblzma5 libuuid1 libsqlite3-0 libncursesw6
  libtinfo6 libreadline8 libcrypt1 libdb5.3 libgdbm6 libnsl2 libtirpc3 libzstd1 libgomp1"
WHEELS="apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post0 numpy==2.2.6 safetensors==0.8.0
  typing_extensions==4.16.0 ml_dtypes==0.6.0"

prepare() {
  mkdir -p "$EMU"
  if [ ! -x "$EMU/qemu/usr/bin/qemu-aarch64-static" ]; then
    (cd "$EMU" && rm -f qemu-user-static*.deb && apt-get download -q qemu-user-static >/dev/null \
      && dpkg -x qemu-user-static*.deb qemu && rm -f qemu-user-static*.deb)
  fi
  if [ ! -x "$EMU/root/usr/bin/python3.11" ]; then
    local apt="$EMU/apt"
    mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/debs"
    local opts=(-o APT::Architecture=arm64 -o APT::Architectures=arm64 -o Dir::State::Lists="$apt/lists"
                -o Dir::Cache="$apt/cache" -o Dir::State::status=/dev/null -o Debug::NoLocking=1)
    apt-get "${opts[@]}" update -q >/dev/null
    (cd "$apt/debs" && apt-get "${opts[@]}" download -q $PACKAGES >/dev/null)
    mkdir -p "$EMU/root"
    for deb in "$apt/debs"/*.deb; do dpkg -x "$deb" "$EMU/root"; done
    rm -rf "$apt"
  fi
  if [ "$(cat "$EMU/site/.wheels" 2>/dev/null)" != "$WHEELS" ]; then
    rm -rf "$EMU/site"
    local wheels="$EMU/wheels"
    mkdir -p "$wheels" "$EMU/site"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_aarch64 \
      --platform manylinux_2_17_aarch64 --platform manylinux_2_28_aarch64 --python-version 3.11 \
      -d "$wheels" $WHEELS
    for whl in "$wheels"/*.whl; do "$PY" -m zipfile -e "$whl" "$EMU/site"; done
    rm -rf "$wheels"
    printf %s "$WHEELS" > "$EMU/site/.wheels"
  fi
}

run() {
  local saved="$1" input="$2" output="$3"
  "$EMU/qemu/usr/bin/qemu-aarch64-static" -L "$EMU/root" \
    -E PYTHONPATH="$EMU/site:$REPO" -E TVM_USE_RUNTIME_LIB=1 -E PYTHONDONTWRITEBYTECODE=1 \
    "$EMU/root/usr/bin/python3.11" -c '
import sys, platform, numpy as np, tvmgraph
assert platform.machine() == "aarch64", platform.machine()
graph = tvmgraph.load(sys.argv[1])
np.save(sys.argv[3], graph(np.load(sys.argv[2])))
' "$saved" "$input" "$output"
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; prepare; run "$@" ;;
  *) echo "usage: $0 prepare | run SAVED_DIR INPUT.npy OUTPUT.npy" >&2; exit 2 ;;
esac
