#!/usr/bin/env bash
# The headline comparison on SmolLM2-135M-Instruct: GRIFFIN vs HASS vs EAGLE-2 drafts trained on
# one shared feature store with the same optimizer steps, one tuned tree budget for all three, evaluated
# together (interleaved) against vanilla decoding, HF generate and HF prompt lookup. Every step resumes
# or is skipped when done, so a rerun after a kill continues. Results: benchmarks/headline/headline.{json,md,png}.
#
#   benchmarks/headline/headline.sh [smollm2-full] [all|train|eval]   # config name under jobs/configs/, phase
#   TUNE_ARGS="--prompts 2 --max-new-tokens 48" benchmarks/headline/headline.sh qwen0.5b-full   # a cheaper tune-tree
#   VARIANTS="eagle hass eagle3 griffin3" benchmarks/headline/headline.sh smollm2-long   # + EAGLE-3 and GRIFFIN-3 rows
#
# EAGLE-3 and GRIFFIN-3 read target layers 2, L/2 and L-3, so they train on a second store of the same
# conversations with those layers (outputs/<name>-layers-features) and the same schedule as GRIFFIN.
set -euo pipefail
cd "$(dirname "$0")/../.."
NAME=${1:-smollm2-full}
PHASE=${2:-all}
CFG=jobs/configs/$NAME.yaml
G=.venv/bin/griffin
source benchmarks/lib.sh
TARGET=$(config_value "$CFG" c.target_slug)
STEPS=$(config_value "$CFG" "sum(s.steps for s in c.train.schedule)")
LR1=$(config_value "$CFG" "c.train.schedule[0].lr")
GRIFFIN=()
HASS=(run_name=$NAME-hass draft.variant=hass registry.model_name=$TARGET-hass)
# EAGLE-2's draft is stage-1 training only: the same total number of optimizer steps in one stage, at
# GRIFFIN's stage-1 lr
EAGLE=(run_name=$NAME-eagle draft.variant=eagle registry.model_name=$TARGET-eagle
       "train.schedule=[{stage: 1, steps: $STEPS, lr: $LR1}]")
LAYERS=(features.store=outputs/$NAME-layers-features)  # features.layers=auto: the variant's layers
EAGLE3=(run_name=$NAME-eagle3 draft.variant=eagle3 registry.model_name=$TARGET-eagle3 "${LAYERS[@]}")
GRIFFIN3=(run_name=$NAME-griffin3 draft.variant=griffin3 registry.model_name=$TARGET-griffin3 "${LAYERS[@]}")
read -r -a OTHERS <<< "${VARIANTS:-eagle hass}"  # compared with GRIFFIN, in this order

if [ "$PHASE" != eval ]; then
  $G featurize -c "$CFG"
  variant() { $G train -c "$CFG" "$@"; $G register -c "$CFG" "$@"; }
  variant "${GRIFFIN[@]}"
  for other in "${OTHERS[@]}"; do
    case $other in
      eagle) variant "${EAGLE[@]}" ;;
      hass) variant "${HASS[@]}" ;;
      eagle3|griffin3)
        $G featurize -c "$CFG" draft.variant=eagle3 "${LAYERS[@]}"  # once; GRIFFIN-3 reads the same layers
        if [ "$other" = eagle3 ]; then variant "${EAGLE3[@]}"; else variant "${GRIFFIN3[@]}"; fi ;;
      *) echo "unknown variant $other (eagle, hass, eagle3, griffin3)"; exit 2 ;;
    esac
  done
fi
[ "$PHASE" = train ] && exit 0
TUNE=outputs/$NAME-griffin/tune_tree/tune_tree.json
[ -f "$TUNE" ] || $G tune-tree -c "$CFG" ${TUNE_ARGS:-} --draft "models:/$TARGET-griffin@candidate"
read -r -a TREE < <(.venv/bin/python -c "import json; print(' '.join(json.load(open('$TUNE'))['overrides']))")
EXTRA=$(for other in "${OTHERS[@]}"; do printf "%s: 'models:/%s-%s@candidate', " "$other" "$TARGET" "$other"; done)
$G eval -c "$CFG" "${TREE[@]}" --draft "models:/$TARGET-griffin@candidate" "eval.extra_drafts={${EXTRA%, }}"
$G register -c "$CFG" --promote
.venv/bin/python benchmarks/headline/headline.py "$NAME"
