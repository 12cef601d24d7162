"""The long-budget drafts on a GPU: HASS, EAGLE-2, EAGLE-3 and GRIFFIN-3 at the shipped GRIFFIN draft's
data and schedule, for the equal-budget comparison (benchmarks/gpu/run.sh, step ``drafts``).

jobs/configs/smollm2-long.yaml (the first 2,500 ShareGPT conversations, 2,353 after the ledger's skips;
stage 1 4,000 steps then stages 2 and 3) for each variant: one feature store with the layers the
multi-layer variants read (every variant finds what it needs in it), then ``griffin train`` per
variant on the GPU. Each variant's best checkpoint leaves as bf16 weights + its config in
OUT/<variant>/ (under the 16 MiB a file the device tool brings back); on the CPU ``griffin ship``
then measures and ships it. Variants start in order while ``--budget-s`` lasts; a variant's
training resumes from its checkpoints when run again.

    python benchmarks/gpu/long_drafts.py --out DIR [--device cuda] [--budget-s 600] [--data FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ["hass", "eagle", "eagle3", "griffin3"]  # eagle = EAGLE-2's draft (EAGLE-1 layout, dynamic trees)
CONFIG = "jobs/configs/smollm2-long.yaml"
FEATURE_LAYERS = "[2, 15, 27]"  # SmolLM2's low, middle and high layers (smollm2-variants.yaml)


def overrides(variant: str, out: Path, device: str, data: str | None) -> list[str]:
    gpu = device == "cuda"
    return [
        f"run_name=smollm2-long-{variant}",
        f"output_dir={out / 'runs'}",
        f"features.store={out / 'runs' / 'features'}",
        f"features.layers={FEATURE_LAYERS}",
        f"draft.variant={variant}",
        f"target.device={device}",
        f"features.gpus_per_actor={1 if gpu else 0}",
        f"train.use_gpu={str(gpu).lower()}",
        f"train.precision={'bf16' if gpu else 'auto'}",
        *([f"data.source={data}"] if data else []),
    ]


def griffin(command: str, args: list[str]) -> int:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", command, "-c", CONFIG, *args]).returncode


def export_bf16(best: Path, dest: Path) -> None:
    """The checkpoint's draft weights in bf16 and its config: what ``griffin ship --source`` reads."""
    from safetensors.torch import load_file, save_file

    from griffin.checkpoint import CONFIG_NAME, WEIGHTS_NAME

    dest.mkdir(parents=True, exist_ok=True)
    state = {k: v.bfloat16() if v.is_floating_point() else v for k, v in load_file(best / WEIGHTS_NAME).items()}
    save_file(state, dest / WEIGHTS_NAME, metadata={"format": "pt"})
    (dest / CONFIG_NAME).write_text((best / CONFIG_NAME).read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=600)
    parser.add_argument("--data", default=None, help="data.source (the carried ShareGPT subset)")
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    args = parser.parse_args()
    deadline, done = time.monotonic() + args.budget_s, {}
    if griffin("featurize", overrides(args.variants[0], args.out, args.device, args.data)) != 0:
        sys.exit("featurize failed")
    for variant in args.variants:
        if time.monotonic() > deadline:
            done[variant] = "not started: out of budget"
            continue
        start = time.monotonic()
        rc = griffin("train", overrides(variant, args.out, args.device, args.data))
        best = args.out / "runs" / f"smollm2-long-{variant}" / "train" / "best"
        if rc == 0 and best.exists():
            export_bf16(best, args.out / variant)
        done[variant] = {
            "rc": rc,
            "seconds": round(time.monotonic() - start, 1),
            "exported": (args.out / variant).exists(),
        }
    (args.out / "long_drafts.json").write_text(json.dumps(done, indent=1) + "\n")
    print(json.dumps(done, indent=1))


if __name__ == "__main__":
    main()
