#!/usr/bin/env bash
# Regenerated vs original answers at equal steps (jobs/configs/smollm2-regen-ab.yaml says what is
# compared), in three arms: the original ShareGPT answers, SmolLM2's greedy answers, and its answers
# sampled at T=0.8. Every step resumes or is skipped when done, so a rerun after a kill continues.
# Each draft is scored on every store's held-out rows, which are the same conversations (a
# regenerated conversation keeps its original's id, which the split hashes) in each arm's answers:
# the greedy rows are what the target writes at T=0, the sampled ones nearer what it writes at T>0.
# Results: benchmarks/regenerated_ab_on_{original,greedy,sampled}.{json,md}.
#
#   nohup benchmarks/ablations/regenerated_ab.sh > outputs/regenerated_ab.log 2>&1 &   # ~1.6 h on 2 AVX-512 BF16 cores (measured)
set -euo pipefail
cd "$(dirname "$0")/../.."
CFG=jobs/configs/smollm2-regen-ab.yaml
G=.venv/bin/griffin
ORIGINAL=()
GREEDY=(run_name=smollm2-regen-ab-regenerated data.source=regenerated
        features.store=outputs/smollm2-regen-ab-regenerated-features)
SAMPLED=(run_name=smollm2-regen-ab-sampled data.source=regenerated regenerate.temperature=0.8
         regenerate.output=outputs/smollm2-regen-ab-sampled
         features.store=outputs/smollm2-regen-ab-sampled-features)
for arm in ORIGINAL GREEDY SAMPLED; do
  declare -n overrides=$arm
  [[ $arm == ORIGINAL ]] || $G regenerate -c "$CFG" "${overrides[@]}"
  $G featurize -c "$CFG" ${overrides[@]+"${overrides[@]}"}
  $G train -c "$CFG" ${overrides[@]+"${overrides[@]}"}
done
DRAFTS=(original=outputs/smollm2-regen-ab-original/train/stage1/best
        greedy=outputs/smollm2-regen-ab-regenerated/train/stage1/best
        sampled=outputs/smollm2-regen-ab-sampled/train/stage1/best)
for store in original:original greedy:regenerated sampled:sampled; do
  .venv/bin/python benchmarks/ablations/heldout_score.py --starts all --store "outputs/smollm2-regen-ab-${store#*:}-features" \
    --out "regenerated_ab_on_${store%%:*}" "${DRAFTS[@]}"
done
