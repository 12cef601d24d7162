#!/usr/bin/env bash
# The long-budget GRIFFIN draft that drafts/<target>/griffin ships: featurize -> train (all stages)
# -> register -> tune-tree -> evaluate (T=0 and T=1, the first $QUESTIONS (default 8) MT-Bench and HumanEval
# questions, vs vanilla and HF generate) ->
# griffin ship (with a draft already shipped, only when SHIP=1). Every step resumes or is skipped when done, so rerunning after a kill continues;
# run it in the background: `nohup benchmarks/long_draft/long_draft.sh > outputs/long_draft.log 2>&1 &`.
#   benchmarks/long_draft/long_draft.sh [config-name] [extra overrides...]
set -euo pipefail
cd "$(dirname "$0")/../.."
NAME=${1:-smollm2-long}
shift || true
CFG=jobs/configs/$NAME.yaml
G=.venv/bin/griffin
source benchmarks/lib.sh
RUN=$(config_value "$CFG" c.run_dir)
MODEL=$(config_value "$CFG" c.model_name)
EVAL=("eval.temperatures=[0, 1]" "eval.num_questions=${QUESTIONS:-8}" "eval.max_new_tokens=128"
      "eval.baselines=[vanilla, hf_generate]")

$G featurize -c "$CFG" "$@"
$G train -c "$CFG" "$@"
$G register -c "$CFG" "$@"
TUNE=$RUN/tune_tree/tune_tree.json
[ -f "$TUNE" ] || $G tune-tree -c "$CFG" --prompts 3 --max-new-tokens 48 --draft "models:/$MODEL@candidate" "$@"
read -r -a TREE < <(.venv/bin/python -c "import json; print(' '.join(json.load(open('$TUNE'))['overrides']))")
[ -f "$RUN/eval/report.json" ] || $G eval -c "$CFG" "${TREE[@]}" "${EVAL[@]}" --draft "models:/$MODEL@candidate" "$@"
$G register -c "$CFG" --promote "$@"
# A shipped draft is replaced only by a better one: with one in place, measure first
# (benchmarks/ablations/vs_shipped.sh <config-name> <out-name>), then ship with SHIP=1 here or there.
SHIPPED=drafts/$(config_value "$CFG" c.target_slug)/griffin
if [ -d "$SHIPPED" ] && [ "${SHIP:-0}" != 1 ]; then
  echo "not shipped: $SHIPPED already holds a draft; compare with benchmarks/ablations/vs_shipped.sh $NAME <out-name>, then rerun with SHIP=1"
  exit 0
fi
$G ship -c "$CFG" --source "models:/$MODEL@candidate" --report "$RUN/eval/report.json" "$@"
