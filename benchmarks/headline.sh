#!/usr/bin/env bash
# The headline comparison on SmolLM2-135M-Instruct: GRIFFIN vs HASS vs EAGLE-2 drafts trained on
# one shared feature store with the same optimizer steps, one tuned tree budget for all three, evaluated
# together (interleaved) against vanilla decoding, HF generate and HF prompt lookup. Every step resumes
# or is skipped when done, so a rerun after a kill continues. Results: benchmarks/headline.{json,md,png}.
#
#   benchmarks/headline.sh [smollm2-full] [all|train|eval]   # config name under jobs/configs/, phase
#   TUNE_ARGS="--prompts 2 --max-new-tokens 48" benchmarks/headline.sh qwen0.5b-full   # a cheaper tune-tree
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${1:-smollm2-full}
PHASE=${2:-all}
CFG=jobs/configs/$NAME.yaml
G=.venv/bin/griffin
TARGET=$(.venv/bin/python -c "from pipeline.config import load_config; print(load_config('$CFG').target_slug)")
STEPS=$(.venv/bin/python -c "from pipeline.config import load_config; print(sum(s.steps for s in load_config('$CFG').train.schedule))")
GRIFFIN=()
HASS=(run_name=$NAME-hass draft.variant=hass registry.model_name=$TARGET-hass)
# EAGLE-2's draft is stage-1 training only: the same total number of optimizer steps in one stage
EAGLE=(run_name=$NAME-eagle draft.variant=eagle registry.model_name=$TARGET-eagle
       "train.schedule=[{stage: 1, steps: $STEPS, lr: 0.0005}]")

if [ "$PHASE" != eval ]; then
  $G featurize -c "$CFG"
  variant() { $G train -c "$CFG" "$@"; $G register -c "$CFG" "$@"; }
  variant "${GRIFFIN[@]}"
  variant "${EAGLE[@]}"
  variant "${HASS[@]}"
fi
[ "$PHASE" = train ] && exit 0
TUNE=outputs/$NAME-griffin/tune_tree/tune_tree.json
[ -f "$TUNE" ] || $G tune-tree -c "$CFG" ${TUNE_ARGS:-} --draft "models:/$TARGET-griffin@candidate"
read -r -a TREE < <(.venv/bin/python -c "import json; print(' '.join(json.load(open('$TUNE'))['overrides']))")
$G eval -c "$CFG" "${TREE[@]}" --draft "models:/$TARGET-griffin@candidate" \
  "eval.extra_drafts={hass: 'models:/$TARGET-hass@candidate', eagle: 'models:/$TARGET-eagle@candidate'}"
$G register -c "$CFG" --promote
.venv/bin/python benchmarks/headline.py "$NAME"
