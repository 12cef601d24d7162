#!/usr/bin/env bash
# More conversations against more epochs, at equal compute: GRIFFIN stage 1 from scratch, 300 steps of
# 2,048 tokens at lr 1e-3 (the best arm of benchmarks/ablations/lr_sweep.sh, which it reuses), on
# - "epochs": the sweep store, 284 conversations (~238k tokens): ~2.6 epochs;
# - "conversations": ~1,000 conversations the sweep never saw (jobs/configs/smollm2-longer.yaml's
#   store, data.skip 2,500): ~0.7 epoch, each row seen once at most.
# Both drafts are scored on both stores' held-out rows, which neither trained on (the two stores hold
# different conversations). Resumable; run lr_sweep.sh first. Results: benchmarks/data_vs_epochs_on_{sweep,new}.{json,md}
set -euo pipefail
cd "$(dirname "$0")/../.."
G=.venv/bin/griffin
source benchmarks/lib.sh
store_of() { config_value "jobs/configs/$1.yaml" c.store_path; }
SWEEP_STORE=$(store_of smollm2-sweep)
NEW_STORE=$(store_of smollm2-longer)
$G featurize -c jobs/configs/smollm2-longer.yaml
$G train -c jobs/configs/smollm2-sweep.yaml run_name=smollm2-sweep-conversations features.store="$NEW_STORE" \
  train.eval_every=100 train.checkpoint_every=100 "train.schedule=[{stage: 1, steps: 300, lr: 0.001}]"
DRAFTS=(epochs=outputs/smollm2-sweep-lr1e-3/train/stage1/best
        conversations=outputs/smollm2-sweep-conversations/train/stage1/best)
for store in sweep:$SWEEP_STORE new:$NEW_STORE; do
  .venv/bin/python benchmarks/ablations/heldout_score.py --starts all --store "${store#*:}" --out "data_vs_epochs_on_${store%%:*}" \
    "${DRAFTS[@]}"
done
