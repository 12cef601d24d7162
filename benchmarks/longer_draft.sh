#!/usr/bin/env bash
# Does more data pay? The shipped GRIFFIN draft continued on 1,000 conversations it has never seen
# (jobs/configs/smollm2-longer.yaml), then measured against the shipped draft it started from:
# - held out: both scored on the new store's held-out rows, which neither trained on;
# - decoded: both drafts interleaved per question in one evaluation, with the shipped draft's tree
#   (its card's), the first $QUESTIONS MT-Bench (both turns) and HumanEval questions, 128 new tokens, T=0 and T=1,
#   vs vanilla and HF generate.
# It ships the new draft (griffin ship) only when SHIP=1: decide from the numbers first.
# Every step resumes or is skipped when done; run it in the background:
#   nohup benchmarks/longer_draft.sh > outputs/longer_draft.log 2>&1 &
# Results: benchmarks/longer_draft.{json,md} (held out), benchmarks/longer_draft/ (the evaluation's report).
set -euo pipefail
cd "$(dirname "$0")/.."
CFG=jobs/configs/smollm2-longer.yaml
G=.venv/bin/griffin
SHIPPED=drafts/smollm2-135m-instruct/griffin
RUN=$(.venv/bin/python -c "from pipeline.config import load_config; print(load_config('$CFG').run_dir)")
STORE=$(.venv/bin/python -c "from pipeline.config import load_config; print(load_config('$CFG').store_path)")
NEW=$RUN/train/stage3/best

$G featurize -c "$CFG"
$G train -c "$CFG"
[ -f benchmarks/longer_draft.json ] || .venv/bin/python benchmarks/heldout_score.py --starts all --store "$STORE" \
  --out longer_draft shipped="$SHIPPED" longer="$NEW"
TREE=$(.venv/bin/python -c "import json; t = json.load(open('$SHIPPED/card.json'))['tree']; print('{' + ', '.join(f'{k}: {v}' for k, v in t.items()) + '}')")
[ -f "$RUN/eval/report.json" ] || $G eval -c "$CFG" --draft "$NEW" "eval.tree=$TREE" "eval.extra_drafts={shipped: $SHIPPED}" \
  "eval.num_questions=${QUESTIONS:-6}" "eval.temperatures=[0, 1]" "eval.max_new_tokens=128" \
  "eval.baselines=[vanilla, hf_generate]"
mkdir -p benchmarks/longer_draft
cp "$RUN"/eval/{report.md,report.json,tau.png,speedup.png} benchmarks/longer_draft/
if [ "${SHIP:-0}" = 1 ]; then
  $G register -c "$CFG" --checkpoint "$NEW"
  $G ship -c "$CFG" --source "$NEW" --report "$RUN/eval/report.json"
fi
