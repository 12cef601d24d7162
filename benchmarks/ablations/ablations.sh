#!/usr/bin/env bash
# The ablations on SmolLM2-135M-Instruct, at a reduced budget, scored by held-out simulated
# acceptance length (eval/sim_accept_len: greedy k-step drafting with the draft's own features on the
# store's held-out rows, the same rows for every run). Needs the headline run's feature store and its
# GRIFFIN stage-1 draft (benchmarks/headline/headline.sh). Resumable; results: benchmarks/ablations/ablations.{json,md}.
#
# A. later stages from the headline GRIFFIN stage-1 draft: top-k of the alignment mask k in {1, 3, 5},
#    passes N in {1, 2, 3, 4} (N=1 is the stage-1 draft itself, N=2..4 the stages of the k=3 run),
#    and mask_shift reference vs decode.
# B. stage 1 only, from scratch: without token-guided fusion, without the token-enhanced head, and
#    the draft vocabulary 8k vs 4k (16k and the full 49152 with ABLATE_LARGE_VOCAB=1: ~2.5x the cost each).
set -euo pipefail
cd "$(dirname "$0")/../.."
CFG=jobs/configs/smollm2-full.yaml
G=.venv/bin/griffin
INIT=outputs/smollm2-full-griffin/train/stage1/best
[ -d "$INIT" ] || { echo "no $INIT: run benchmarks/headline/headline.sh (its GRIFFIN stage 1) first" >&2; exit 2; }
S2=30; S3=20; S4=20; S1=100
# one held-out evaluation per stage (at its last step): each costs ~35 s on this CPU
LATER=("train.init_from=$INIT" train.eval_every=100 train.checkpoint_every=100)
run() { local name=$1; shift; $G train -c "$CFG" "run_name=smollm2-abl-$name" "$@"; }

run k3 "${LATER[@]}" "train.schedule=[{stage: 2, steps: $S2, lr: 0.0002}, {stage: 3, steps: $S3, lr: 0.0002}, {stage: 4, steps: $S4, lr: 0.0002}]"
for k in 1 5; do
  run k$k "${LATER[@]}" train.method.align_top_k=$k "train.schedule=[{stage: 2, steps: $S2, lr: 0.0002}, {stage: 3, steps: $S3, lr: 0.0002}]"
done
run shift-decode "${LATER[@]}" train.method.mask_shift=decode "train.schedule=[{stage: 2, steps: $S2, lr: 0.0002}, {stage: 3, steps: $S3, lr: 0.0002}]"

STAGE1=(train.eval_every=100 train.checkpoint_every=100 "train.schedule=[{stage: 1, steps: $S1, lr: 0.0005}]")
run s1-base "${STAGE1[@]}"
run s1-no-tgf "${STAGE1[@]}" draft.overrides.token_guided_fusion=false
run s1-no-teh "${STAGE1[@]}" draft.overrides.token_enhanced_head=false
run s1-vocab-4k "${STAGE1[@]}" draft.draft_vocab_size=4096
if [ "${ABLATE_LARGE_VOCAB:-0}" = 1 ]; then  # ~2.5x the cost of an 8k run each; off in the committed results
  run s1-vocab-16k "${STAGE1[@]}" draft.draft_vocab_size=16384
  run s1-vocab-full "${STAGE1[@]}" draft.draft_vocab_size=null
fi
.venv/bin/python benchmarks/ablations/ablations.py
