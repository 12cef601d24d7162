#!/usr/bin/env bash
# Online against offline features on SmolLM2-135M-Instruct (benchmarks/scale_out/online_offline.py):
# featurize a small ShareGPT slice once, then a fresh stage 1 offline / online / offline / online.
# Run from the repository root; PYTHON overrides the interpreter (default .venv/bin/python).
# Extra arguments go to the script (e.g. --steps 20 --repeats 3). Log: $WORK/online_offline.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
WORK=${WORK:-/tmp/griffin-scale-out-bench}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the Ray workers import the project too
mkdir -p "$(dirname "$WORK")"
"$PYTHON" benchmarks/scale_out/online_offline.py --work "$WORK" \
    --limit 48 --max-len 256 --steps 12 --skip 2 --repeats 2 "$@" 2>&1 | tee "$WORK.log"
