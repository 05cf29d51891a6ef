#!/bin/sh
# aarch64.sh - make test-aarch64: the library on AArch64, with its NEON kernels,
# cross-compiled and run under user-mode qemu. Run from the repository root.
#
#   1. compile checks: pqcache.h warning-free (-Wall -Wextra -Werror -pedantic) with the
#      cross gcc as C99 (the test program's build) and with PQCACHE_NO_SIMD, as C++11
#      where the cross g++ is there; with clang --target=aarch64-linux-gnu as C99 and
#      C++11 where clang can use the cross toolchain
#   2. under qemu-aarch64, small scenarios (PQC_TEST_SIZE=small), in one program
#      (tests/test_lib.c, PQC_TEST_SUITES="kernels core golden"): test_kernels (every
#      NEON kernel against its scalar reference, bit for bit), test_core (training,
#      codes, search and top-k at every level: NEON and scalar give the same bits) and
#      test_golden (the selections and the cache file recorded by an x86 build)
#
# What it needs: aarch64-linux-gnu-gcc with the AArch64 C library, and qemu-aarch64
# (Debian: gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6-dev-arm64-cross
# qemu-user). Missing, and running as root with apt-get, it installs them; where they
# cannot be had, the group is skipped with a SKIP line (in CI, with CI set, it fails).
# Environment: MAKE, AARCH64_CC, AARCH64_CXX, QEMU_AARCH64 (the emulator),
# AARCH64_SYSROOT (its -L; default /usr/aarch64-linux-gnu), CLANG.
set -u
MAKE=${MAKE:-make}
ACC=${AARCH64_CC:-aarch64-linux-gnu-gcc}
ACXX=${AARCH64_CXX:-aarch64-linux-gnu-g++}
SYSROOT=${AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}
CLANG=${CLANG:-clang}
B=build/aarch64
PKGS="gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"
pass=0
fail=0

skip() {
    echo "SKIP test-aarch64: $1"
    echo "0 passed, 0 failed, 1 skipped"
    exit 0
}

# the emulator: QEMU_AARCH64, else qemu-aarch64 or qemu-aarch64-static from PATH
find_qemu() {
    for q in ${QEMU_AARCH64:-} qemu-aarch64 qemu-aarch64-static; do
        if command -v "$q" >/dev/null 2>&1; then
            echo "$q"
            return 0
        fi
    done
    return 1
}

# the cross compiler builds a program that runs under the emulator
works() {
    q=$(find_qemu) || return 1
    command -v "$ACC" >/dev/null 2>&1 || return 1
    mkdir -p $B
    printf '#include <stdio.h>\nint main(void) { puts("ok"); return 0; }\n' > $B/probe.c
    "$ACC" $B/probe.c -o $B/probe >/dev/null 2>&1 || return 1
    [ "$("$q" -L "$SYSROOT" $B/probe 2>/dev/null)" = ok ]
}

if ! works; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "test-aarch64: installing $PKGS (apt-get)"
        export DEBIAN_FRONTEND=noninteractive
        # shellcheck disable=SC2086
        apt-get install -y -qq -o DPkg::Lock::Timeout=300 $PKGS >/dev/null 2>&1 ||
            { apt-get update -qq >/dev/null 2>&1 &&
              apt-get install -y -qq -o DPkg::Lock::Timeout=300 $PKGS >/dev/null 2>&1; } ||
            echo "test-aarch64: apt-get could not install them"
    fi
    if ! works && [ -n "${CI:-}" ]; then
        # in CI (.ci/run installs them) the group must run, not skip
        echo "FAIL test-aarch64: no AArch64 cross compiler and qemu-aarch64 that run a program (CI is set)"
        echo "0 passed, 1 failed"
        exit 1
    fi
    works || skip "no AArch64 cross compiler and qemu-aarch64 that run a program (Debian: apt-get install $PKGS; as root, make test-aarch64 installs them itself)"
fi
QEMU=$(find_qemu)
echo "test-aarch64: $("$ACC" --version | head -n 1); $("$QEMU" --version | head -n 1)"

ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL test-aarch64: $1"; }
amake() { $MAKE --no-print-directory AARCH64_CC="$ACC" AARCH64_CXX="$ACXX" CLANG="$CLANG" "$@"; }

# 1. compile checks (each its own make target; a parallel make runs them side by side)
# (gcc as C99 in the default configuration is the test program's build below)
checks="gcc-c99--nosimd-static"
if command -v "$ACXX" >/dev/null 2>&1; then
    checks="$checks gxx-cxx--default"
else
    echo "test-aarch64: no $ACXX; the C++ compile check is left out"
fi
# clang, where it can target AArch64 with the cross toolchain's headers
probe='#include <arm_neon.h>\n#include <stdio.h>\n#include <math.h>\nint main(void) { return 0; }\n'
for mode in c99 cxx; do
    case $mode in c99) lang="-x c -std=c99" ;; *) lang="-x c++ -std=c++11" ;; esac
    # shellcheck disable=SC2086
    if command -v "$CLANG" >/dev/null 2>&1 &&
       printf "$probe" | "$CLANG" --target=aarch64-linux-gnu $lang -fsyntax-only - >/dev/null 2>&1; then
        checks="$checks clang-$mode--default"
    else
        echo "test-aarch64: $CLANG cannot compile $mode for aarch64-linux-gnu here; that compile check is left out"
    fi
done
targets=""
for c in $checks; do targets="$targets $B/checks/$c.o"; done
targets="$targets $B/aarch64_test_lib"
# shellcheck disable=SC2086
amake -k $targets || echo "test-aarch64: some builds failed (above)"
# a target that failed to build is still out of date (make -q), whatever is left of it
for c in $checks; do
    if amake -q "$B/checks/$c.o" >/dev/null 2>&1; then
        echo "compile check: aarch64-$c ok"
        ok
    else
        bad "compile check aarch64-$c"
    fi
done

# 2. the tests under the emulator, small scenarios: the suites of test_kernels, test_core
# and test_golden in one program (tests/test_lib.c)
if ! amake -q "$B/aarch64_test_lib" >/dev/null 2>&1; then
    bad "test_lib did not build"
else
    echo "== kernels core golden (aarch64, under $QEMU, small scenarios)"
    if PQC_TEST_SUITES="kernels core golden" PQC_TEST_SIZE=small "$QEMU" -L "$SYSROOT" "$B/aarch64_test_lib"; then
        ok
    else
        bad "test_lib (kernels core golden)"
    fi
fi

if [ "$fail" = 0 ]; then
    echo "test-aarch64: all checks passed ($pass: compile checks and test programs)"
else
    echo "test-aarch64: $fail of $((pass + fail)) compile checks and test programs failed"
fi
[ "$fail" = 0 ]
