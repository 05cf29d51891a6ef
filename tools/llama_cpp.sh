#!/bin/sh
# tools/llama_cpp.sh - llama.cpp with examples/llama_cpp/llama.cpp.patch applied, built for
# the CPU (static libraries), cached outside the clone.
#
# The source is the llama.cpp that PyPI's llama-cpp-python 0.3.36 vendors (its source
# distribution, sha256 pinned below). Under $PQC_CACHE/llama.cpp (default
# ~/.cache/pqcache/llama.cpp) it keeps:
#   src-VER      the pristine source, unpacked once;
#   patched-VER  a copy with the patch applied: when the patch changes, only the files it
#                touches are restored and patched again, so that a rebuild stays small;
#   build-VER    CMake's build of libllama and ggml (CPU only, no OpenMP, no tools).
# build/llama_cpp_src and build/llama_cpp_build in the clone link to the patched source
# and the build (make build/pqc_llama compiles against them). Later runs reuse everything; a second run with nothing changed takes a
# second or two.
#
# usage: sh tools/llama_cpp.sh [--check]   (--check: only verify that the patch applies
#        to the pristine source, which is fetched if needed)
set -eu

VER=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
SDIST=llama_cpp_python-$VER.tar.gz

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${PQC_CACHE:-$HOME/.cache/pqcache}/llama.cpp
PATCH=$ROOT/examples/llama_cpp/llama.cpp.patch
SRC=$CACHE/src-$VER
PATCHED=$CACHE/patched-$VER
BUILD=$CACHE/build-$VER
JOBS=$(nproc 2>/dev/null || echo 2)

say() { echo "llama_cpp.sh: $*"; }
die() { echo "llama_cpp.sh: $*" >&2; exit 1; }

for t in python3 patch cmake c++ tar; do
    command -v "$t" >/dev/null 2>&1 || die "needs $t (sh tools/setup.sh installs it)"
done
mkdir -p "$CACHE"

# 1. The pinned source distribution, from PyPI's simple index (pip download would build the
#    package's metadata first, a minute of compiling for nothing).
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    if [ ! -f "$CACHE/$SDIST" ]; then
        say "fetching llama-cpp-python $VER's source distribution from PyPI (77 MB)"
        python3 - "$CACHE/$SDIST" "$VER" "$SHA256" <<'EOF' || die "cannot fetch llama-cpp-python $VER from PyPI (needed: its source distribution, sha256 $SHA256)"
import hashlib, re, sys, urllib.request
out, ver, want = sys.argv[1:4]
index = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/", timeout=120).read().decode()
m = re.search(r'href="([^"#]*llama_cpp_python-%s\.tar\.gz)' % re.escape(ver), index)
if not m:
    sys.exit("llama-cpp-python %s is not on PyPI's index" % ver)
data = urllib.request.urlopen(m.group(1), timeout=600).read()
got = hashlib.sha256(data).hexdigest()
if got != want:
    sys.exit("sha256 %s, expected %s" % (got, want))
with open(out + ".part", "wb") as f:
    f.write(data)
import os
os.replace(out + ".part", out)
EOF
    fi
    say "unpacking vendor/llama.cpp"
    rm -rf "$CACHE/unpack" "$SRC"
    mkdir -p "$CACHE/unpack"
    tar -xzf "$CACHE/$SDIST" -C "$CACHE/unpack" "llama_cpp_python-$VER/vendor/llama.cpp"
    mv "$CACHE/unpack/llama_cpp_python-$VER/vendor/llama.cpp" "$SRC"
    rm -rf "$CACHE/unpack"
    rm -f "$SRC/.git" # a submodule's pointer into the package's own repository
fi

# 2. The patch must apply to the pristine source as it is.
patch -p1 --dry-run --quiet -d "$SRC" <"$PATCH" >/dev/null ||
    die "examples/llama_cpp/llama.cpp.patch does not apply to llama.cpp of llama-cpp-python $VER"
if [ "${1:-}" = "--check" ]; then
    say "the patch applies to llama.cpp of llama-cpp-python $VER"
    exit 0
fi

# 3. The patched copy: files the patch touched last time are restored, then patched.
if [ ! -f "$PATCHED/CMakeLists.txt" ]; then
    rm -rf "$PATCHED"
    cp -a "$SRC" "$PATCHED"
    rm -f "$PATCHED/.pqc-patch"
fi
if ! cmp -s "$PATCH" "$PATCHED/.pqc-patch" 2>/dev/null; then
    if [ -f "$PATCHED/.pqc-patch" ]; then
        for f in $(sed -n 's|^+++ b/||p' "$PATCHED/.pqc-patch"); do cp -p "$SRC/$f" "$PATCHED/$f"; done
    fi
    say "applying llama.cpp.patch"
    patch -p1 --quiet -d "$PATCHED" <"$PATCH" || die "the patch failed on the copy in $PATCHED"
    cp "$PATCH" "$PATCHED/.pqc-patch"
fi

# 4. libllama and ggml, CPU only.
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
    say "configuring (CMake, CPU only)"
    cmake -S "$PATCHED" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_OPENMP=OFF \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >"$CACHE/configure.log" 2>&1 ||
        die "CMake failed to configure llama.cpp (see $CACHE/configure.log)"
fi
say "building libllama (first time: several minutes on 2 cores)"
cmake --build "$BUILD" --target llama -j "$JOBS" >"$CACHE/build.log" 2>&1 ||
    { tail -20 "$CACHE/build.log" >&2; die "building llama.cpp failed (see $CACHE/build.log)"; }

mkdir -p "$ROOT/build"
ln -sfn "$PATCHED" "$ROOT/build/llama_cpp_src"
ln -sfn "$BUILD" "$ROOT/build/llama_cpp_build"
say "ready: build/llama_cpp_src, build/llama_cpp_build (llama.cpp of llama-cpp-python $VER, patched)"
