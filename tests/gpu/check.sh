#!/bin/sh
# check.sh - GPU checks and benchmarks of pqcache's CUDA kernels (needs an NVIDIA GPU).
#
# Builds build/gpu_check (cc + libdl; the CUDA driver, NVRTC and cuBLASLt are dlopen'ed
# at run time), runs every kernel against CPU reference implementations, then times the
# per-layer selection (LUT + scan + top-k) and the K/V gather, and prints a summary
# table. The whole script stays well under 5 minutes, build included.
#
# usage: tests/gpu/check.sh [gpu_check options: -v --quick --no-bench --no-blaslt --seed N]
# exit status: 0 all checks passed, 1 a check failed, 2 no usable GPU, 124 timeout.
set -u
cd "$(dirname "$0")/../.." || exit 1
CC=${CC:-cc}
LIMIT=${PQC_GPU_CHECK_TIMEOUT:-270}

if ! sh tools/embed_kernels.sh --check; then
    echo "check.sh: the kernels embedded in pqcache.h do not match pqcache_kernels.cu;" \
         "run tools/embed_kernels.sh first" >&2
    exit 1
fi

mkdir -p build
echo "== building build/gpu_check"
$CC -std=c99 -O2 -Wall -Wextra -o build/gpu_check tests/gpu/gpu_check.c -lm -lpthread -ldl || exit 1

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
        2>/dev/null || true
fi

echo "== running build/gpu_check (limit ${LIMIT}s)"
if command -v timeout >/dev/null 2>&1; then
    timeout "$LIMIT" ./build/gpu_check --cache build/kernel-cache "$@"
else
    ./build/gpu_check --cache build/kernel-cache "$@"
fi
rc=$?
case $rc in
    0)   echo "== GPU checks passed" ;;
    2)   echo "== GPU checks not run: they need an NVIDIA GPU with its driver" ;;
    124) echo "== GPU checks timed out after ${LIMIT}s" ;;
    *)   echo "== GPU checks FAILED (exit status $rc)" ;;
esac
exit $rc
