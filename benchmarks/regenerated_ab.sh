#!/usr/bin/env bash
# Regenerated vs original answers at equal steps (jobs/configs/smollm2-regen-ab.yaml says what is
# compared). Every step resumes or is skipped when done, so a rerun after a kill continues. Each
# draft is scored on both stores' held-out rows, which are the same conversations (a regenerated
# conversation keeps its original's id, which the split hashes), in the two arms' answers: the
# regenerated rows are what the target itself writes, so they are the closer stand-in for decoding. Results: benchmarks/regenerated_ab_on_{original,regenerated}.{json,md}.
#
#   nohup benchmarks/regenerated_ab.sh > outputs/regenerated_ab.log 2>&1 &   # ~1.5-2 h on a 2-core AMX CPU
set -euo pipefail
cd "$(dirname "$0")/.."
CFG=jobs/configs/smollm2-regen-ab.yaml
G=.venv/bin/griffin
REGEN=(run_name=smollm2-regen-ab-regenerated data.source=regenerated
       features.store=outputs/smollm2-regen-ab-regenerated-features)
$G regenerate -c "$CFG"
$G featurize -c "$CFG"
$G featurize -c "$CFG" "${REGEN[@]}"
$G train -c "$CFG"
$G train -c "$CFG" "${REGEN[@]}"
DRAFTS=(original=outputs/smollm2-regen-ab-original/train/stage1/best
        regenerated=outputs/smollm2-regen-ab-regenerated/train/stage1/best)
for store in original regenerated; do
  .venv/bin/python benchmarks/heldout_score.py --starts all --store "outputs/smollm2-regen-ab-$store-features" \
    --out "regenerated_ab_on_$store" "${DRAFTS[@]}"
done
