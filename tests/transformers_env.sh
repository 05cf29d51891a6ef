#!/bin/sh
# Prints the path of a python3 that has torch, transformers, numpy and pytest, making
# one first when needed: $PQC_TORCH_PYTHON when set (used as it is), else a virtual
# environment in build/venv-hf, created and filled from PyPI on the first call (torch
# with its own dependencies: about 4 GB to download once). For make test-transformers.
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
echo "transformers_env: installing torch, transformers, numpy and pytest into $venv (once)" >&2
python3 -m venv "$venv" >&2 || /usr/bin/python3 -m venv "$venv" >&2
"$py" -m pip install -q --upgrade pip >&2
"$py" -m pip install -q torch transformers safetensors numpy pytest >&2
"$py" -c 'import torch, transformers' >&2
echo "$py"
