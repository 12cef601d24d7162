#!/usr/bin/env bash
# The drafts work's learning-rate / batch-tokens sweep: GRIFFIN stage 1 from scratch on the sweep store
# (jobs/configs/smollm2-sweep.yaml), the same seed and held-out rows and the same training tokens per
# arm (STEPS x 2,048), one change per arm against the configs' default (lr 5e-4, 2,048-token batches).
# The LR decays over each arm's steps, as in every config. Scored by the held-out expected accepted
# tokens at each checkpoint. Resumable (rerun it: finished arms are skipped, a cut arm resumes);
# results: benchmarks/ablations/lr_sweep.{json,md}.
#
#   benchmarks/ablations/lr_sweep.sh [arm ...]   # arms: lr2.5e-4 lr5e-4 lr1e-3 lr2e-3 b4096-lr1e-3 (default: all)
set -euo pipefail
cd "$(dirname "$0")/../.."
CFG=jobs/configs/smollm2-sweep.yaml
STEPS=${STEPS:-300}
# arm name -> "lr batch_tokens": the steps shrink with the batch so that every arm sees STEPS x 2,048 tokens
declare -A SPEC=([lr2.5e-4]="0.00025 2048" [lr5e-4]="0.0005 2048" [lr1e-3]="0.001 2048" [lr2e-3]="0.002 2048"
                 [b4096-lr1e-3]="0.001 4096")
ORDER=(lr5e-4 lr1e-3 lr2e-3 lr2.5e-4 b4096-lr1e-3)
arm() {
  local name=$1 lr batch
  read -r lr batch <<<"${SPEC[$name]}"
  local steps=$(( STEPS * 2048 / batch )) every=$(( STEPS * 2048 / batch / 3 ))
  .venv/bin/griffin train -c "$CFG" "run_name=smollm2-sweep-$name" train.batch_tokens="$batch" \
    train.eval_every="$every" train.checkpoint_every="$every" "train.schedule=[{stage: 1, steps: $steps, lr: $lr}]"
}
.venv/bin/griffin featurize -c "$CFG"  # a finished store is kept; a cut one resumes
ARMS=("$@")
[ ${#ARMS[@]} -gt 0 ] || ARMS=("${ORDER[@]}")
for name in "${ARMS[@]}"; do
  [ -n "${SPEC[$name]:-}" ] || { echo "unknown arm $name (${ORDER[*]})"; exit 2; }
  arm "$name"
done
labels=()
for name in "${ORDER[@]}"; do read -r lr batch <<<"${SPEC[$name]}"; labels+=("$name=lr $lr, $batch-token batches"); done
.venv/bin/python benchmarks/ablations/stage1_ablations.py --config smollm2-sweep --prefix smollm2-sweep- --base lr5e-4 \
  --out lr_sweep --arms "${labels[@]}"
