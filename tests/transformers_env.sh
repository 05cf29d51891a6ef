#!/bin/sh
# Prints the path of a python3 that has torch, transformers, numpy and pytest, making
# one first when needed: $PQC_TORCH_PYTHON when set (used as it is), else a virtual
# environment in build/venv-hf, created and filled from PyPI on the first call (torch
# with its own dependencies: about 4 GB to download, 2 minutes here). It also makes
# build/hf4: transformers 4.x and the hub and tokenizers versions it needs, installed
# apart (about 240 MB), which PYTHONPATH=build/hf4 puts in front of the 5.x in the same
# python, so that checkpoints in the layout transformers 4 writes are tested with
# transformers 4 itself. .ci/run calls it; make test's group test-transformers calls it
# with --check, which only looks.
set -e
if [ -n "$PQC_TORCH_PYTHON" ]; then
    echo "$PQC_TORCH_PYTHON"
    exit 0
fi
venv=build/venv-hf
py=$venv/bin/python3
hf4=build/hf4
have5() { [ -x "$py" ] && "$py" -c 'import torch, transformers, numpy, pytest' >/dev/null 2>&1; }
have4() { PYTHONPATH=$hf4 "$py" -c 'import transformers, sys; sys.exit(transformers.__version__[0] != "4")' >/dev/null 2>&1; }
if have5 && have4; then
    echo "$py"
    exit 0
fi
if [ "${1:-}" = --check ]; then
    echo "transformers_env: no python with torch and transformers 5 and 4: run sh tests/transformers_env.sh once" \
         "(it makes build/venv-hf, about 4 GB, and build/hf4), or set PQC_TORCH_PYTHON" >&2
    exit 1
fi
if ! have5; then
    echo "transformers_env: installing torch, transformers, numpy and pytest into $venv (once)" >&2
    python3 -m venv "$venv" >&2 || /usr/bin/python3 -m venv "$venv" >&2
    "$py" -m pip install -q --upgrade pip >&2
    "$py" -m pip install -q --no-cache-dir torch==2.15.0 transformers==5.24.0 safetensors numpy pytest >&2
    "$py" -c 'import torch, transformers' >&2
fi
if ! have4; then
    echo "transformers_env: installing transformers 4.57 into $hf4 (once)" >&2
    rm -rf "$hf4"
    "$py" -m pip install -q --no-cache-dir --target "$hf4" transformers==4.57.6 >&2
    rm -rf "$hf4"/numpy "$hf4"/numpy-* "$hf4"/numpy.libs "$hf4"/bin   # the venv's own numpy serves both
    have4
fi
echo "$py"
