#!/bin/sh
# Prints the path of a python3 that has torch, transformers, numpy and pytest, making
# one first when needed: $PQC_TORCH_PYTHON when set (used as it is), else a virtual
# environment in build/venv-hf, created and filled from PyPI on the first call (torch
# with its own dependencies: about 4 GB to download, 2 minutes here). .ci/run calls it;
# make test's group test-transformers calls it with --check, which only looks.
set -e
if [ -n "$PQC_TORCH_PYTHON" ]; then
    echo "$PQC_TORCH_PYTHON"
    exit 0
fi
venv=build/venv-hf
py=$venv/bin/python3
if [ -x "$py" ] && "$py" -c 'import torch, transformers, numpy, pytest' >/dev/null 2>&1; then
    echo "$py"
    exit 0
fi
if [ "${1:-}" = --check ]; then
    echo "transformers_env: no python with torch and transformers: run sh tests/transformers_env.sh once" \
         "(it makes build/venv-hf, about 4 GB), or set PQC_TORCH_PYTHON" >&2
    exit 1
fi
echo "transformers_env: installing torch, transformers, numpy and pytest into $venv (once)" >&2
python3 -m venv "$venv" >&2 || /usr/bin/python3 -m venv "$venv" >&2
"$py" -m pip install -q --upgrade pip >&2
"$py" -m pip install -q torch==2.15.0 transformers==5.24.0 safetensors numpy pytest >&2
"$py" -c 'import torch, transformers' >&2
echo "$py"
