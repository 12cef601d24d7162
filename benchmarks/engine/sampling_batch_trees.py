"""Does drafting pay at T = 1 with B rows at once? Decode tokens/s of B calibration prompts decoded
together through the engine (``pipeline.evaluate.batch_policy.measure_policy``, which ``griffin
tune-tree`` measures ``decode.sampling_policy`` with; batch 1 is always among the batches), plain rows
vs a range of trees: the T = 1 picks of tune-tree here (4/1/8; 4/1/3 and 4/1/4 in other runs) and their
neighbours, down to 2-token trees and up to a T = 0 policy's 4/3/10.

SmolLM2-135M-Instruct fp32 with the shipped GRIFFIN draft, 1 thread (a decoder replica's
``serve.num_cpus: 1``), seeded rows (row i with seed i), 48 tokens each, interleaved over repetitions
(medians; repetition 0 warms up). Writes sampling_batch_trees.json.

    python benchmarks/engine/sampling_batch_trees.py [--batches 1 4] [--reps 3] [--new 48]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

OUT = Path(__file__).parent
DRAFT = "drafts/smollm2-135m-instruct/griffin"
TREES = ["4/1/8", "4/2/3", "4/3/10", "3/2/2", "3/3/1", "2/1/2", "2/2/1"]


def main() -> None:
    from griffin.config import SamplingConfig, TreeConfig
    from pipeline.config import load_config
    from pipeline.evaluate.batch_policy import measure_policy
    from pipeline.evaluate.report import machine_identity
    from pipeline.evaluate.tune import calibration_prompts
    from pipeline.resources.drafts import load_draft_uri
    from pipeline.resources.targets import load_decoding_target

    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config("jobs/configs/smollm2-quick.yaml", ["target.dtype=float32", "output_dir=/tmp/sampling_batch"])
    target = load_decoding_target(cfg)
    draft = load_draft_uri(DRAFT, target, cfg)
    prompts = [ids[0].tolist() for ids in calibration_prompts(cfg, target.tokenizer, 8)]
    trees = [TreeConfig(**dict(zip(("total_tokens", "depth", "top_k"), map(int, t.split("/"))))) for t in TREES]
    sampling = SamplingConfig(temperature=1.0)
    _, curve = measure_policy(target, draft, prompts, trees, args.batches, args.new, args.reps, sampling)
    plain = {row["batch"]: row["tokens_per_s"] for row in curve if row["tree"] == "plain"}
    results = [{**row, "vs_plain": row["tokens_per_s"] / plain[row["batch"]]} for row in curve]
    for row in results:
        print(
            f"batch {row['batch']} {row['tree']:7s} {row['tokens_per_s']:6.1f} tokens/s  {row['vs_plain']:.2f}x plain"
        )
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_identity(),
        "target": "SmolLM2-135M-Instruct fp32",
        "draft": DRAFT,
        "temperature": 1.0,
        "new_tokens": args.new,
        "reps": args.reps,
        "threads": 1,
        "results": results,
    }
    (OUT / "sampling_batch_trees.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
