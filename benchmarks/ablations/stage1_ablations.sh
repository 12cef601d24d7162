#!/usr/bin/env bash
# Stage-1 ablations of the drafts work on the long store: GRIFFIN stage 1 from scratch, the same steps,
# seed and held-out rows, one change per arm against the default (`base`):
# - window: train.method.loss_window "reference" (EAGLE's unshifted mask) against the default "draft"
#   (the pairs a decode drafts, from a reply's first token; docs/method.md §1);
# - init: the draft's decoder layer started from the target's last layer (draft.init_layer=-1)
#   against a random init.
# Scored by the held-out expected accepted tokens, whose chains always start on the "draft" window,
# so every arm is scored on the same pairs. Resumable; results: benchmarks/ablations/stage1_ablations.{json,md}.
#
#   benchmarks/ablations/stage1_ablations.sh [base window init]   # ~8 min of both cores an arm (2-core AMX CPU)
set -euo pipefail
cd "$(dirname "$0")/../.."
CFG=jobs/configs/smollm2-long.yaml
STEPS=${STEPS:-400}
STAGE1=(train.eval_every=100 train.checkpoint_every=100 "train.schedule=[{stage: 1, steps: $STEPS, lr: 0.0005}]")
arm() { local run=$1; shift; .venv/bin/griffin train -c "$CFG" "run_name=smollm2-abl-$run" "${STAGE1[@]}" "$@"; }
ARMS=("$@")
[ ${#ARMS[@]} -gt 0 ] || ARMS=(base window init)
for name in "${ARMS[@]}"; do
  case $name in
    base) arm window-draft ;;
    window) arm window-reference train.method.loss_window=reference ;;
    init) arm init-last draft.init_layer=-1 ;;
    *) echo "unknown arm $name (base, window, init)"; exit 2 ;;
  esac
done
.venv/bin/python benchmarks/ablations/stage1_ablations.py
