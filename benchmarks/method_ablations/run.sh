#!/usr/bin/env bash
# Method ablations on SmolLM2 at the variants comparison's short budget (jobs/configs/smollm2-variants.yaml:
# 284 ShareGPT conversations, 400 stage-1 steps at 5e-4, then 40 steps of three passes at 3e-5, 8k draft
# vocabulary), one store for every run. Each run changes one thing against its baseline:
#
#   g-kl          GRIFFIN, the defaults (baseline)            e3 / g3      EAGLE-3 / GRIFFIN-3, defaults (full TTT backprop)
#   g-lk          GRIFFIN, token_loss=lk_hybrid               e3-lk        EAGLE-3, token_loss=lk_hybrid
#   g-reply       GRIFFIN, vocabulary from reply tokens       e3-oov       EAGLE-3, skip_out_of_vocab
#   e3-perpass / g3-perpass   stage 3 only, from e3's / g3's stage-1 best, ttt_backprop=per_pass
#   g-pw08 / e3-pw08          stage 3 only, from g-kl's / e3's stage-1 best, pass weights 0.8^k
#
# (Stage 1 runs one pass, where TTT backprop and pass weights change nothing, so those ablations share
# their baseline's stage 1 and differ only in stage 3.) g-reply and e3-oov run the first 200 of the
# baseline's 400 stage-1 steps, with the same learning-rate schedule (its decay set to 400 steps), and
# are compared with the baseline's held-out score at step 200. Every run resumes or is skipped when done.
# Then one interleaved in-process evaluation decodes the GRIFFIN and EAGLE-3 drafts with KL and with
# LK-hybrid against vanilla decoding (10 MT-Bench questions x 2 turns + 10 HumanEval, T=0 and T=1,
# 64 tokens, the shipped draft's tree 12/3/10). benchmarks/method_ablations/collect.py writes the tables.
#
#   benchmarks/method_ablations/run.sh [RUN ...|eval]     (no argument: every run, then the evaluation)
set -euo pipefail
cd "$(dirname "$0")/../.."
CFG=jobs/configs/smollm2-variants.yaml
G=.venv/bin/griffin
out() { echo "outputs/smollm2-abl-$1"; }
STAGE3_ONLY="train.schedule=[{stage: 3, steps: 40, lr: 0.00003}]"
HALF_STAGE1="train.schedule=[{stage: 1, steps: 200, lr: 0.0005}]"  # with train.method.total_steps=400

overrides() {  # the overrides of one run
  case $1 in
    g-kl) echo "draft.variant=griffin" ;;
    e3) echo "draft.variant=eagle3" ;;
    g3) echo "draft.variant=griffin3" ;;
    g-lk) echo "draft.variant=griffin train.method.token_loss=lk_hybrid" ;;
    e3-lk) echo "draft.variant=eagle3 train.method.token_loss=lk_hybrid" ;;
    g-reply) echo "draft.variant=griffin draft.vocab_from=reply" ;;
    e3-oov) echo "draft.variant=eagle3 train.method.skip_out_of_vocab=true" ;;
    e3-perpass) echo "draft.variant=eagle3 train.method.ttt_backprop=per_pass train.init_from=$(out e3)/train/stage1/best" ;;
    g3-perpass) echo "draft.variant=griffin3 train.method.ttt_backprop=per_pass train.init_from=$(out g3)/train/stage1/best" ;;
    g-pw08) echo "draft.variant=griffin train.method.pass_weight_decay=0.8 train.init_from=$(out g-kl)/train/stage1/best" ;;
    e3-pw08) echo "draft.variant=eagle3 train.method.pass_weight_decay=0.8 train.init_from=$(out e3)/train/stage1/best" ;;
    *) echo "unknown run $1" >&2; exit 2 ;;
  esac
}

train() {
  local name=$1 extra=()
  case $name in
    *-perpass|*-pw08) extra=("$STAGE3_ONLY") ;;
    g-reply|e3-oov) extra=("$HALF_STAGE1" train.method.total_steps=400) ;;
  esac
  # shellcheck disable=SC2046
  $G train -c "$CFG" run_name="smollm2-abl-$name" registry.model_name="smollm2-abl-$name" \
    $(overrides "$name") "${extra[@]}"
}

evaluate() {  # GRIFFIN (KL) is the main draft; the others ride along, interleaved in one process
  $G eval -c "$CFG" run_name=smollm2-abl-g-kl --draft "$(out g-kl)/train/best" \
    "eval.extra_drafts={griffin_lk: '$(out g-lk)/train/best', eagle3: '$(out e3)/train/best', \
eagle3_lk: '$(out e3-lk)/train/best'}" \
    eval.num_questions=10 "eval.temperatures=[0.0, 1.0]" eval.max_new_tokens=64 "eval.baselines=[vanilla]" \
    eval.tree.total_tokens=12 eval.tree.depth=3 eval.tree.top_k=10 "$@"
}

RUNS=(g-kl e3 g3 g-lk e3-lk e3-perpass g3-perpass g-pw08 g-reply e3-oov e3-pw08)
$G featurize -c "$CFG"
if [ $# -eq 0 ]; then
  for name in "${RUNS[@]}"; do train "$name"; done
  evaluate
elif [ "$1" = eval ]; then
  shift
  evaluate "$@"
else
  for name in "$@"; do train "$name"; done
fi
