"""Resident memory of a training worker once its draft is built: with the whole target kept beside
the draft (before) or lent and dropped (``pipeline.train.worker._worker_draft``, now).

Each arm runs in its own fresh process, three times alternating, builds what a ``griffin train``
worker of the config builds before its first step (on the CPU), and reads its RSS from
/proc/self/statm. Writes benchmarks/training/train_memory.{json,md}.

    python benchmarks/training/train_memory.py [-c jobs/configs/smollm2-quick.yaml]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[2]
ARM = """
import gc, json, sys
sys.path.insert(0, {root!r})
from pipeline.config import load_config
from pipeline.resources.targets import load_target
from pipeline.train.worker import _init_draft, _worker_draft
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
cfg = load_config({config!r})
init_dir = str(cfg.train.init_from) if cfg.train.init_from else None
if {arm!r} == "whole":  # the worker before: the target loaded on the worker's device and kept
    target = load_target(cfg.target)
    draft = _init_draft(cfg, target, init_dir, None)
    head = target.head_weight
else:
    draft, head = _worker_draft(cfg, init_dir, None, "cpu")
gc.collect()
print(json.dumps({{"rss_mib": rss_mib(), "draft_params": sum(p.numel() for p in draft.parameters())}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-c", "--config", default="jobs/configs/smollm2-quick.yaml")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"whole": [], "lent": []}
    for _ in range(3):
        for arm in runs:
            code = ARM.format(root=str(ROOT), config=args.config, arm=arm)
            result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
            if result.returncode != 0:
                sys.exit(result.stderr[-3000:])
            runs[arm].append(json.loads(result.stdout.strip().splitlines()[-1]))
    summary = {arm: median(r["rss_mib"] for r in rows) for arm, rows in runs.items()}
    out = Path(__file__).parent
    (out / "train_memory.json").write_text(
        json.dumps({"config": args.config, "runs": runs, "median_rss_mib": summary}, indent=2)
    )
    whole, lent = summary["whole"], summary["lent"]
    lines = [
        f"`{args.config}`: resident memory (RSS) of a fresh process that has built a training worker's draft "
        "(on the CPU), median of 3.",
        "",
        "| training worker | RSS, MiB |",
        "|---|---|",
        f"| whole target kept beside the draft (before) | {whole:.0f} |",
        f"| target lent and dropped: embedding and LM head kept (now) | {lent:.0f} |",
        "",
        f"Now / before: {lent / whole:.2f} ({whole - lent:.0f} MiB less per worker).",
    ]
    (out / "train_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
