#!/bin/sh
# bench/setup.sh - create the Python environment used by the faiss side of `make bench`.
#
# Idempotent: creates build/venv (python3 -m venv) under the repository root and installs
# pinned wheels of numpy, faiss-cpu (PyPI build, with AVX2 kernels) and threadpoolctl.
# A second run that finds everything in place prints a single line and exits 0.
#
# Environment:
#   PYTHON        interpreter used to create the venv (default: python3)
#   PQC_BENCH_VENV  venv location (default: <repo>/build/venv)
#
# If the interpreter lacks the venv/ensurepip module (Debian without python3-venv) and we
# run as root with apt-get available, python3-venv is installed; otherwise we stop with a
# hint.
set -eu

NUMPY_VERSION=2.4.6
FAISS_VERSION=1.15.1
THREADPOOLCTL_VERSION=3.7.0

here=$(CDPATH='' cd -- "$(dirname -- "$0")" && pwd)
root=$(dirname -- "$here")
venv=${PQC_BENCH_VENV:-$root/build/venv}
py=${PYTHON:-python3}

check_env() {
    # exit 0 when the venv exists and holds exactly the pinned versions
    [ -x "$venv/bin/python" ] || return 1
    "$venv/bin/python" - "$NUMPY_VERSION" "$FAISS_VERSION" <<'PYEOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
import numpy, faiss  # noqa: F401  (must import, not only be listed)
ok = version("numpy") == sys.argv[1] and version("faiss-cpu") == sys.argv[2]
sys.exit(0 if ok else 1)
PYEOF
}

if check_env; then
    echo "bench venv ready: $venv (numpy $NUMPY_VERSION, faiss-cpu $FAISS_VERSION)"
    exit 0
fi

if ! command -v "$py" >/dev/null 2>&1; then
    echo "setup.sh: $py not found; install python3 (>= 3.9)" >&2
    exit 1
fi

# A venv whose interpreter no longer runs (moved or removed python) is rebuilt from scratch.
if [ -e "$venv" ] && ! "$venv/bin/python" -c "" >/dev/null 2>&1; then
    echo "setup.sh: removing broken venv $venv"
    rm -rf "$venv"
fi

if [ ! -x "$venv/bin/python" ]; then
    if ! "$py" -c "import venv, ensurepip" >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
            echo "setup.sh: installing python3-venv (python$pyver-venv) with apt-get"
            export DEBIAN_FRONTEND=noninteractive
            apt-get update -qq >/dev/null
            apt-get install -y -qq python3-venv >/dev/null ||
                apt-get install -y -qq "python$pyver-venv" >/dev/null
            if ! "$py" -c "import venv, ensurepip" >/dev/null 2>&1; then
                echo "setup.sh: $py still has no venv/ensurepip module (not Debian's python3?);" \
                     "set PYTHON to an interpreter that has it" >&2
                exit 1
            fi
        else
            echo "setup.sh: $py has no venv/ensurepip module;" \
                 "install python3-venv (as root: apt-get install -y python3-venv)" >&2
            exit 1
        fi
    fi
    echo "setup.sh: creating $venv"
    mkdir -p "$(dirname -- "$venv")"
    # a half-made venv (no pip) from an earlier failed attempt is replaced
    rm -rf "$venv"
    "$py" -m venv "$venv"
fi

echo "setup.sh: installing numpy==$NUMPY_VERSION faiss-cpu==$FAISS_VERSION threadpoolctl==$THREADPOOLCTL_VERSION"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    --only-binary=:all: \
    "numpy==$NUMPY_VERSION" "faiss-cpu==$FAISS_VERSION" "threadpoolctl==$THREADPOOLCTL_VERSION"

if ! check_env; then
    echo "setup.sh: installed packages do not import; see the pip output above" >&2
    exit 1
fi
"$venv/bin/python" -c 'import faiss, numpy; print("bench venv ready: faiss", faiss.__version__, "numpy", numpy.__version__)'
