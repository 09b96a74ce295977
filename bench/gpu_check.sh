#!/usr/bin/env bash
# GPU path check, for a CUDA machine with the project installed (`make install`), < 8 minutes:
# parity tests on CUDA, the engine bench on the 246M preset M, CUDA-graph capture per decode
# bucket, and the allocator-stats checks. One summary line per check (CHECK <name> PASS|FAIL).
#
#     bench/gpu_check.sh [--model DIR]        # default: synthesises preset m into a temp dir
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
rc=0
# parity (our fp32 logits on CUDA vs transformers), engine bench, graphs, allocator: 7 min cap
timeout 420 "$PY" bench/gpu_checks.py --device cuda "$@" || rc=1
exit $rc
