#!/usr/bin/env bash
# GRIFFIN vs EAGLE-3 vs GRIFFIN-3 on SmolLM2 at equal data and steps (jobs/configs/smollm2-variants.yaml):
# one feature store with EAGLE-3's layers, the same schedule for each variant, then one interleaved
# in-process evaluation of the three drafts against vanilla decoding with the config's tree. Every step
# resumes or is skipped when done, so a rerun after a kill continues. Results: the three runs'
# held-out metrics (outputs/smollm2-variants-*/train/stage*/_complete.json) and the evaluation report
# (outputs/smollm2-variants-griffin/eval/report.{json,md}).
#
#   benchmarks/variants/variants.sh [all|train|eval] [eval overrides...]
set -euo pipefail
cd "$(dirname "$0")/../.."
PHASE=${1:-all}
shift || true
CFG=jobs/configs/smollm2-variants.yaml
G=.venv/bin/griffin
run() { echo "run_name=smollm2-variants-$1 draft.variant=$1 registry.model_name=smollm2-135m-instruct-$1"; }
if [ "$PHASE" != eval ]; then
  $G featurize -c "$CFG"
  for variant in griffin eagle3 griffin3; do
    # shellcheck disable=SC2046
    $G train -c "$CFG" $(run $variant)
  done
fi
[ "$PHASE" = train ] && exit 0
best() { echo "outputs/smollm2-variants-$1/train/best"; }
$G eval -c "$CFG" --draft "$(best griffin)" \
  "eval.extra_drafts={eagle3: '$(best eagle3)', griffin3: '$(best griffin3)'}" "$@"
