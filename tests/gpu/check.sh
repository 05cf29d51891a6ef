#!/bin/sh
# check.sh - GPU checks and benchmarks of pqcache's CUDA device tier (needs an NVIDIA GPU).
#
# One prepared run, build included, well under 5 minutes:
#   1. gpu_check: every kernel against CPU reference implementations, then the per-layer
#      selection (tables + scan + top-k, 8 KV heads, d_h 128, 32K and 128K tokens) and
#      the K/V gather (misses from pinned host memory against the measured pinned
#      host-to-device copy bandwidth, hits from the device block cache), and the k-means
#      assignment step (n 32K and 128K, d 64 and 128, k 256): its kernel against the
#      cuBLASLt GEMM path, as the library times them, and which one it picks; and the
#      lookup tables of pqc_batch_select over 8 and 32 sequences: the table kernel per
#      sequence against one pointer-array cuBLASLt matmul, likewise;
#   2. test_cuda_tier: sequence caches on the GPU against the same caches on the CPU
#      (selections, gathered rows, statistics, growth, rebuilds, the engine's stream);
#   3. test_pqcache_mode --cuda: a whole tiny_llama decode with the CUDA device tier
#      against the CPU tier (same next tokens, logits);
#   4. bench_cache --backend cuda: select and fetch through the library at 32K and 128K,
#      as separate calls (a round trip per layer) and as the device step (none), for the
#      default (re-ranking the PQ top 1.5k on the device: the candidates' key rows cross
#      the bus) and for the PQ top-k alone (--rerank -1), bytes up per step beside each.
# The CUDA driver, NVRTC and cuBLASLt are opened at run time; nothing links against them.
#
# usage: tests/gpu/check.sh [--quick] [--driver PATH]
#   --quick        smaller sizes, a smoke run
#   --driver PATH  a libcuda to open instead of the system's (e.g. build/libcuda-emu.so,
#                  the CPU stand-in of `make test-cuda-emu`, to rehearse this script
#                  where there is no GPU; its timings mean nothing). A stand-in that
#                  also provides cuBLASLt is used as cuBLASLt too (PQC_CUBLASLT_PATH)
# exit status: 0 all checks passed, 1 a check failed, 2 no usable GPU.
set -u
cd "$(dirname "$0")/../.." || exit 1
CC=${CC:-cc}
LIMIT=${PQC_GPU_CHECK_TIMEOUT:-150}
QUICK=""
SIZES=32768,131072
DRIVER=""
EXTRA=""
while [ $# -gt 0 ]; do
    case $1 in
        --quick) QUICK=--quick; SIZES=4096,8192 ;;
        --driver) DRIVER=$2; shift ;;
        *) echo "usage: $0 [--quick] [--driver PATH]" >&2; exit 1 ;;
    esac
    shift
done

if ! sh tools/embed_kernels.sh --check; then
    echo "check.sh: the kernels embedded in pqcache.h do not match pqcache_kernels.cu;" \
         "run tools/embed_kernels.sh first" >&2
    exit 1
fi

mkdir -p build
echo "== building (cc; the CUDA libraries are opened at run time)"
F="-std=c99 -O2 -Wall -Wextra -Werror -pedantic"
$CC $F -o build/gpu_check tests/gpu/gpu_check.c -lm -lpthread -ldl &&
$CC $F -Itests -o build/test_cuda_tier tests/test_cuda_tier.c -lm -lpthread -ldl &&
$CC $F -o build/test_pqcache_mode examples/tiny_llama/test_pqcache_mode.c -lm -lpthread -ldl &&
$CC $F -o build/bench_cache bench/bench_cache.c -lm -lpthread -ldl || exit 1

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
        2>/dev/null || true
fi
# NVRTC: the loader looks on the library path and in /usr/local/cuda/lib64; where CUDA
# came as Python wheels (nvidia-cuda-nvrtc), point PQC_NVRTC_PATH at that copy
if [ -z "${PQC_NVRTC_PATH:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so' &&
   ! ls /usr/local/cuda/lib64/libnvrtc.so* >/dev/null 2>&1 && command -v python3 >/dev/null 2>&1; then
    for d in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
        f=$(ls "$d"/nvidia/*/lib/libnvrtc.so.1[0-9]* "$d"/nvidia/cuda_nvrtc/lib/libnvrtc.so.1[0-9]* 2>/dev/null | head -n 1)
        if [ -n "$f" ]; then
            PQC_NVRTC_PATH=$f
            export PQC_NVRTC_PATH
            echo "== NVRTC: $f"
            break
        fi
    done
fi
if [ -n "$DRIVER" ]; then
    PQC_CUDA_DRIVER_PATH=$(cd "$(dirname "$DRIVER")" && pwd)/$(basename "$DRIVER")
    export PQC_CUDA_DRIVER_PATH
    echo "== driver: $PQC_CUDA_DRIVER_PATH"
    if [ -z "${PQC_CUBLASLT_PATH:-}" ]; then
        if grep -q cublasLtMatmulAlgoGetHeuristic "$PQC_CUDA_DRIVER_PATH" 2>/dev/null; then
            PQC_CUBLASLT_PATH=$PQC_CUDA_DRIVER_PATH  # the stand-in's cuBLASLt
            export PQC_CUBLASLT_PATH
            echo "== cuBLASLt: $PQC_CUBLASLT_PATH"
        else
            EXTRA=--no-blaslt  # cuBLASLt needs the real driver
        fi
    fi
else
    unset PQC_CUDA_DRIVER_PATH  # the system's driver
fi

run() { # run NAME COMMAND...: a time limit, the status remembered
    name=$1
    shift
    echo "== $name"
    if command -v timeout >/dev/null 2>&1; then timeout "$LIMIT" "$@"; else "$@"; fi
    rc=$?
    case $rc in
        0) ;;
        2) [ "$name" = gpu_check ] && { echo "== GPU checks not run: they need an NVIDIA GPU with its driver"; exit 2; }
           failed="$failed $name" ;;
        124) echo "== $name timed out after ${LIMIT}s"; failed="$failed $name" ;;
        *) failed="$failed $name" ;;
    esac
}
failed=""
run gpu_check ./build/gpu_check --cache build/kernel-cache $QUICK $EXTRA
run test_cuda_tier ./build/test_cuda_tier
run tiny_llama_cuda ./build/test_pqcache_mode --cuda
run bench_cache ./build/bench_cache --backend cuda --select-only --threads 8 --sizes $SIZES --rerank -1
if [ -n "$failed" ]; then
    echo "== GPU checks FAILED:$failed"
    exit 1
fi
echo "== GPU checks passed"
exit 0
