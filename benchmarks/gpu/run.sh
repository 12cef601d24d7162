#!/usr/bin/env bash
# All the GPU work, prepared here and run there in as few calls as possible (docs/scaling.md §8,
# "Running on a GPU host"). A host with PyTorch + CUDA but no package index gets what it lacks as
# checked parts of limited size (benchmarks/gpu/stage.py).
#
#   benchmarks/gpu/run.sh stage      here: wheels + data -> .gpu/parts (part-NN + MANIFEST.json), the call plan
#   benchmarks/gpu/run.sh receive    there, every call: the carried .gpu/parts into $STAGE (outlives the call
#                                    while the machine is warm)
#   benchmarks/gpu/run.sh all        there, once every part is in: install, then the steps below
#   benchmarks/gpu/run.sh dry-run    here, on the CPU: stage, receive each part as its own call would, then
#                                    `all` with the sizes cut down (DRY=1): every step but the transfers
#
# The steps of `all`, in priority order (STEPS picks some; each logs to $OUT/<step>.log):
#   install   check every part's sha256, join, unpack, pip install --no-index --no-deps into $STAGE/site
#   smoke     does the compiler work here: a reduce-overhead compile of a tiny function, a compiled decode of
#             the tiny target == eager, the CUDA graphs it recorded (benchmarks/gpu/smoke.py, $OUT/smoke.json)
#   tests     the gpu-marked tests (tests/test_gpu.py), junit in $OUT
#   pipeline  griffin run -c jobs/configs/smollm2-gpu.yaml through a local Ray on the GPU, timed per stage, with
#             the serving policy measured at batch 1 only (decode.tune_batches=[1]) to fit its time limit
#   decode    benchmarks/gpu/gpu_decode.py with the tree tune-tree picked: compiled vs eager, bf16 vs fp32, T=0/1
#   drafts    the long-budget HASS, EAGLE-2, EAGLE-3 and GRIFFIN-3 drafts (smollm2-long.yaml), while time is left
#   results   $OUT/gpu.json and gpu.md: the machine, date, torch and every figure (benchmarks/gpu/results.py)
# Each step has a time limit of its own (LIMIT_<STEP>_S, e.g. LIMIT_PIPELINE_S=480), so a step that overruns
# is stopped (rc 124; 137 if it ignored SIGTERM for 20 s) and the later ones, results above all, still run.
# DEADLINE_S (seconds from the start of `all`) cuts every limit to what is left, keeping 90 s for results. Compiles are cached under
# $STAGE/inductor (TORCHINDUCTOR_CACHE_DIR): a later step, or a later call on the same machine, reuses them.
# Env: OUT (default outputs/gpu), STAGE (default /tmp/griffin-gpu), GPU_DIR (default .gpu), STEPS, TREE
# (the decode step's tree, total/depth/top_k; default: the pipeline's tune-tree pick, else 60/6/10),
# BUDGET_S (the decode step's seconds, default 240), DRAFT_BUDGET_S (default 0: no drafts), PY
# (default .venv/bin/python where it exists, else python3). Arguments after stage / dry-run go to
# stage.py stage (--part-mib, --requirements, --find-links, --conversations).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/outputs/gpu}
STAGE=${STAGE:-/tmp/griffin-gpu}
GPU_DIR=${GPU_DIR:-.gpu}  # the staged parts, here (ignored by git: carried by name)
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}  # there: the image's python3
DRY=${DRY:-0}
STEPS="${STEPS:-install smoke tests pipeline decode drafts} results"  # results always: each run writes its gpu.json
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

config_overrides() {  # one override a line: the pipeline on the GPU reads the carried ShareGPT subset;
  # a dry run cuts every size down, on the CPU (the training worker leaves CPUs for the stream's Ray Data
  # tasks; the decoder replica leaves one for the two ingress replicas' halves)
  printf '%s\n' "data.source=$STAGE/bundle/data/sharegpt.json" "output_dir=$OUT/pipeline"
  [ "$DRY" = 1 ] || printf '%s\n' "decode.tune_batches=[1]"  # the batch-8 policy: ~2 minutes of compiles more
  [ "$DRY" = 1 ] && printf '%s\n' target.device=cpu target.dtype=auto features.gpus_per_actor=0 \
    train.use_gpu=false train.precision=auto serve.num_gpus=0 serve.num_cpus=3 serve.max_batch=4 serve.max_ongoing_requests=4 \
    cluster.num_cpus=4 train.cpus_per_worker=2 data.limit=12 "train.schedule=[{stage: 3, steps: 2, lr: 0.00002}]" train.eval_every=2 \
    train.checkpoint_every=2 decode.tune_prompts=2 decode.tune_max_new_tokens=16 "decode.tune_batches=[1, 2]" \
    decode.tree.total_tokens=12 decode.tree.depth=3 decode.tree.top_k=4 eval.num_questions=1 eval.max_new_tokens=16
  return 0
}

step() {  # step NAME LIMIT_S COMMAND...: run it under its time limit (LIMIT_<NAME>_S overrides), log it, time
  # it; a failed or stopped step does not stop the later ones
  local name=$1 override="LIMIT_${1^^}_S"
  local limit=${!override:-$2}
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  if [ -n "${DEADLINE_S:-}" ] && [ "$name" != results ]; then  # what is left, less a minute and a half for results
    local left=$((DEADLINE_S - (SECONDS - RUN_START) - 90))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -le 0 ]; then
      echo "=== $name: skipped, no time left before DEADLINE_S ==="
      echo "{\"step\": \"$name\", \"rc\": 124, \"seconds\": 0}" >> "$OUT/steps.jsonl"
      return 0
    fi
  fi
  echo "=== $name ($(date -u +%H:%M:%S), at most $limit s) ==="
  local start=$SECONDS
  timeout --kill-after=20 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start))}" >> "$OUT/steps.jsonl"
  echo "=== $name: rc $rc in $((SECONDS - start)) s ==="
  [ "$name" != install ] || [ "$rc" = 0 ] || exit "$rc"  # nothing runs without the packages
}

tuned_tree() {  # the tree the pipeline's tune-tree picked, as total/depth/top_k
  $PY -c "import json, sys; b = json.load(open(sys.argv[1]))['best']; print(f\"{b['total_tokens']}/{b['depth']}/{b['top_k']}\")" \
    "$OUT/pipeline/smollm2-gpu/tune_tree/tune_tree.json" 2>/dev/null || echo 60/6/10
}

run_all() {
  RUN_START=$SECONDS
  rm -f "$OUT/steps.jsonl"
  export PYTHONPATH="$STAGE/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  export TORCHINDUCTOR_CACHE_DIR="$STAGE/inductor"
  local device=cuda questions=8 new=128 budget=${BUDGET_S:-240} phases=4 compiles=300
  # on a CPU the decode step's compiles alone take ~5 minutes (measured: the step took 353 s with budget 60)
  if [ "$DRY" = 1 ]; then device=cpu questions=1 new=16 budget=60 phases=1 compiles=600; fi
  step install 240 $PY benchmarks/gpu/stage.py install "$STAGE"
  step smoke 300 $PY benchmarks/gpu/smoke.py --out "$OUT" --device "$device"
  step tests 420 $PY -m pytest -m gpu tests/test_gpu.py -v -p no:cacheprovider --timeout 300 --junitxml "$OUT/gpu_tests.xml"
  local overrides
  mapfile -t overrides < <(config_overrides)
  step pipeline 540 $PY -m pipeline.cli run -c jobs/configs/smollm2-gpu.yaml "${overrides[@]}"
  step decode $((budget + compiles)) $PY benchmarks/gpu/gpu_decode.py --out "$OUT" --device "$device" --tree "${TREE:-$(tuned_tree)}" \
    --questions "$questions" --new "$new" --budget-s "$budget" --phases "$phases"
  if [ "${DRAFT_BUDGET_S:-0}" != 0 ]; then
    step drafts $((DRAFT_BUDGET_S + 300)) $PY benchmarks/gpu/long_drafts.py --out "$OUT/drafts" --device "$device" --budget-s "$DRAFT_BUDGET_S" \
      --data "$STAGE/bundle/data/sharegpt.json"
  fi
  step results 120 $PY benchmarks/gpu/results.py "$OUT"
}

case "${1:-}" in
  stage)
    $PY benchmarks/gpu/stage.py stage --out "$GPU_DIR" "${@:2}" || exit 1
    echo "call plan: one device call per part, carry [\".gpu/parts/part-NN\", \".gpu/parts/MANIFEST.json\"],"
    echo "command 'benchmarks/gpu/run.sh receive'; the last part's call runs 'benchmarks/gpu/run.sh receive && benchmarks/gpu/run.sh all'"
    ;;
  receive) $PY benchmarks/gpu/stage.py receive "$GPU_DIR/parts" "$STAGE" ;;
  all) run_all ;;
  dry-run)
    export DRY=1  # the wheels for this interpreter: the dry run installs and imports them here
    here=$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    $PY benchmarks/gpu/stage.py stage --out "$GPU_DIR" --python-version "$here" "${@:2}" || exit 1
    rm -rf "$STAGE"
    for part in "$GPU_DIR"/parts/part-*; do  # each part as its own call would carry it
      carried=$(mktemp -d)
      cp "$part" "$GPU_DIR/parts/MANIFEST.json" "$carried/"
      $PY benchmarks/gpu/stage.py receive "$carried" "$STAGE" || exit 1
      rm -rf "$carried"
    done
    run_all
    ;;
  *)
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
