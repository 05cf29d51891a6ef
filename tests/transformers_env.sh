#!/bin/sh
# Prints the path of a python3 that has torch, transformers 5, numpy and pytest:
# $PQC_TORCH_PYTHON when set (used as it is), else build/venv-hf's, the environment that
# tools/setup.sh makes once outside the clone and links there (with build/hf4:
# transformers 4.x apart, which PYTHONPATH=build/hf4 puts in front of the 5.x in the same
# python, so that checkpoints in the layout transformers 4 writes are tested with
# transformers 4 itself). Without --check it runs tools/setup.sh first where they are
# missing; make test's groups call it with --check, which only looks.
set -e
if [ -n "$PQC_TORCH_PYTHON" ]; then
    echo "$PQC_TORCH_PYTHON"
    exit 0
fi
py=build/venv-hf/bin/python3
have() {
    [ -x "$py" ] && [ -d build/hf4/transformers ] &&
        "$py" -c 'import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ("torch", "transformers", "numpy", "pytest")))' >/dev/null 2>&1
}
if ! have; then
    if [ "${1:-}" = --check ]; then
        echo "transformers_env: no python with torch and transformers 5 and 4: run sh tools/setup.sh once" \
             "(it makes the Python environments, about 6 GB, outside the clone), or set PQC_TORCH_PYTHON" >&2
        exit 1
    fi
    sh tools/setup.sh >&2
    have
fi
echo "$py"
