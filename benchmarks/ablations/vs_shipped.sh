#!/usr/bin/env bash
# A candidate GRIFFIN draft against the shipped one, the test a draft passes before it replaces
# drafts/<target>/griffin:
# - train: the config's featurize and training (both resume, or skip when done); the candidate is
#   the best checkpoint of the schedule's last stage;
# - held out: both drafts scored on the held-out rows of $HELDOUT_STORE (default: the config's store).
#   Neither draft may have trained on them. Rows from the candidate's own new conversations flatter it
#   (history.md, the top-k section): for such a candidate, pass a store that neither draft's data is near;
# - decoded: both drafts interleaved per question in one evaluation (run outputs/<out-name>), with the
#   shipped draft's tree (its card's), the first $QUESTIONS (default 6) MT-Bench (both turns) and
#   HumanEval questions, 128 new tokens, T=0 and T=1, vs vanilla and HF generate.
# Each measurement is skipped when its output exists: measure again under a new out-name.
# It ships the candidate (griffin ship) only when SHIP=1: decide from the numbers first.
#   benchmarks/ablations/vs_shipped.sh <config-name> <out-name>
#   HELDOUT_STORE=outputs/smollm2-sweep-features nohup benchmarks/ablations/vs_shipped.sh smollm2-longer longer_draft \
#     > outputs/longer_draft.log 2>&1 &
#   QUESTIONS=20 nohup benchmarks/ablations/vs_shipped.sh smollm2-long long_lr1e-3 > outputs/long_lr1e-3_ab.log 2>&1 &
# Results: benchmarks/ablations/<out-name>.{json,md} (held out), benchmarks/ablations/<out-name>/ (the evaluation's report).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -eq 2 ] || { echo "usage: benchmarks/ablations/vs_shipped.sh <config-name> <out-name>"; exit 2; }
NAME=$1
OUT=$2
CFG=jobs/configs/$NAME.yaml
G=.venv/bin/griffin
source benchmarks/lib.sh
py() { config_value "$CFG" "$1"; }
SHIPPED=drafts/$(py c.target_slug)/griffin
RUN=$(py c.run_dir)
STORE=${HELDOUT_STORE:-$(py c.store_path)}
NEW=$RUN/train/stage$(py 'c.train.schedule[-1].stage')/best
EVAL_DIR=$(py "c.model_copy(update={'run_name': '$OUT'}).run_dir")/eval  # outputs/<out-name>/eval

$G featurize -c "$CFG"
$G train -c "$CFG"
[ -f "benchmarks/ablations/$OUT.json" ] || .venv/bin/python benchmarks/ablations/heldout_score.py --config "$CFG" --starts all \
  --store "$STORE" --out "$OUT" shipped="$SHIPPED" "$NAME=$NEW"
TREE=$(.venv/bin/python -c "import json; t = json.load(open('$SHIPPED/card.json'))['tree']; print('{' + ', '.join(f'{k}: {v}' for k, v in t.items()) + '}')")
REPORT=$EVAL_DIR/report.json
[ -f "$REPORT" ] || $G eval -c "$CFG" run_name="$OUT" --draft "$NEW" "eval.tree=$TREE" \
  "eval.extra_drafts={shipped: $SHIPPED}" "eval.num_questions=${QUESTIONS:-6}" "eval.temperatures=[0, 1]" \
  "eval.max_new_tokens=128" "eval.baselines=[vanilla, hf_generate]"
mkdir -p "benchmarks/ablations/$OUT"
cp "$EVAL_DIR"/{report.md,report.json,tau.png,speedup.png} "benchmarks/ablations/$OUT/"
if [ "${SHIP:-0}" = 1 ]; then
  $G register -c "$CFG" --checkpoint "$NEW"
  $G ship -c "$CFG" --source "$NEW" --report "$REPORT"
fi
