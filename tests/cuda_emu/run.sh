#!/bin/sh
# run.sh - the CUDA checks that need no GPU: every kernel (gpu_check --quick), the
# device-tier tests (under ASan+UBSan, and plain) and a whole tiny_llama decode on the
# device tier, all on the CPU stand-in driver (which also stands in for cuBLASLt).
# usage: tests/cuda_emu/run.sh BUILD_DIR [SIZE]   (make test-cuda-emu builds everything
# first). SIZE small (make test): the device-tier tests run under ASan+UBSan on the small
# scenarios, the plain build only the test that compiles with NVRTC (too slow under ASan);
# full (make test-long) or none: the plain build runs every test, full size, as well.
# Without NVRTC the kernels cannot be built and the checks are reported as skipped.
set -u
B=${1:-build}
SIZE=${2:-full}
EMU=$(cd "$B" && pwd)/libcuda-emu.so
export PQC_CUDA_DRIVER_PATH="$EMU"
PQC_CUBLASLT_PATH="$EMU"  # the stand-in is cuBLASLt too
export PQC_CUBLASLT_PATH
XDG_CACHE_HOME=$(cd "$B" && pwd)/xdg-cache  # the kernel cache of runtimes that use the default
export XDG_CACHE_HOME
PQC_TEST_KERNEL_CACHE=$XDG_CACHE_HOME/pqcache  # and the device-tier tests' (tests/test_util.h)
export PQC_TEST_KERNEL_CACHE
st=0
echo "== kernels on the stand-in driver (gpu_check --quick)"
# (in the kernel cache every runtime below uses: compiled once, here, and loaded from then
# on; its second build checks the load)
"$B/gpu_check" --quick --no-bench --cache "$PQC_TEST_KERNEL_CACHE"
rc=$?
if [ $rc = 2 ]; then
    echo "SKIP kernels on the stand-in driver: no NVRTC"
    echo "0 passed, 0 failed, 1 skipped"
elif [ $rc != 0 ]; then
    st=1
fi
if [ "$SIZE" = small ]; then
    echo "== CUDA device tier: the kernel cache (NVRTC compiles; the other tests under ASan below)"
    PQC_TEST_SIZE=small "$B/test_cuda_tier" -t kernel_cache_reused || st=1
else
    echo "== CUDA device tier against the CPU tier"
    "$B/test_cuda_tier" || st=1
fi
echo "== a whole tiny_llama decode on the CUDA device tier against the CPU tier"
"$B/test_pqcache_mode" --cuda || st=1
echo "== CUDA device tier (ASan+UBSan)"
# (less the kernel cache's test, which spends its time in an NVRTC compile: the plain
# run above has it)
# (make test's small scenarios: the same code, half the decoding)
PQC_TEST_SIZE=$SIZE ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 "$B/asan_cuda_tier" -x kernel_cache_reused || st=1
exit $st
