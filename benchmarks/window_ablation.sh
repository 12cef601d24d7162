#!/usr/bin/env bash
# The first-draft window ablation (docs/method.md §1): GRIFFIN stage 1 from scratch on the long store,
# the same steps, seed and held-out rows, with train.method.loss_window "draft" (the default: the
# pairs a decode drafts, from a reply's first token) against "reference" (EAGLE's unshifted mask).
# Scored by the held-out expected accepted tokens, whose chains always start on the "draft" window,
# so both arms are scored on the same pairs. Resumable; results: benchmarks/window_ablation.{json,md}.
#
#   benchmarks/window_ablation.sh        # ~25 min of both cores on a 2-core AMX CPU
set -euo pipefail
cd "$(dirname "$0")/.."
CFG=jobs/configs/smollm2-long.yaml
STEPS=${STEPS:-400}
STAGE1=(train.eval_every=100 train.checkpoint_every=100 "train.schedule=[{stage: 1, steps: $STEPS, lr: 0.0005}]")
for window in draft reference; do
  .venv/bin/griffin train -c "$CFG" "run_name=smollm2-abl-window-$window" train.method.loss_window=$window "${STAGE1[@]}"
done
.venv/bin/python benchmarks/window_ablation.py
