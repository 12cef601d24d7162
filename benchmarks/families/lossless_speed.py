"""The per-layer-kind masks (griffin.families) cost nothing on a full-attention target: before vs after, in one process.

The baseline is the ``griffin`` package as of commit ``BEFORE`` (one mask for every layer), extracted from
git as ``griffin_before`` (benchmarks/engine/lone_request.py's mechanism), so both run interleaved on one
machine: SmolLM2-135M-Instruct with the shipped GRIFFIN draft, MT-Bench first turns, T=0, the tree 12/3/10,
plus vanilla decoding. Outputs are checked equal. Writes lossless_speed[-fp32].json.

    python benchmarks/families/lossless_speed.py [--dtype float32] [--prompts 8] [--new 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from lone_request import baseline_package, old_models, time_interleaved  # noqa: E402

BEFORE = "562f8ab"  # main before the target families
OUT = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    import importlib

    from griffin.config import SamplingConfig, TreeConfig
    from pipeline.config import load_config
    from pipeline.data.chat import render_chat
    from pipeline.evaluate.report import machine_identity
    from pipeline.resources.drafts import load_draft_uri
    from pipeline.resources.questions import load_questions
    from pipeline.resources.targets import load_target

    torch.set_num_threads(1)  # a serving replica's threads on this machine (num_cpus 1)
    cfg = load_config("jobs/configs/smollm2-quick.yaml", [f"target.dtype={args.dtype}"])
    new_decode = importlib.import_module("griffin.decode")
    target = load_target(cfg.target, decoding=True)
    draft = load_draft_uri("drafts/smollm2-135m-instruct/griffin", target, cfg)
    with tempfile.TemporaryDirectory() as folder:
        old = baseline_package(Path(folder), BEFORE, "griffin_before")
        old_decode, old_config = importlib.import_module(f"{old}.decode"), importlib.import_module(f"{old}.config")
        old_target, old_draft = old_models(old, target, draft)
        greedy, tree = SamplingConfig(), TreeConfig(total_tokens=12, depth=3, top_k=10)
        old_greedy, old_tree = old_config.SamplingConfig(), old_config.TreeConfig(**tree.model_dump())
        prompts = [
            torch.tensor([render_chat(target.tokenizer, [{"role": "user", "content": q["turns"][0]}])])
            for q in load_questions("mt_bench", args.prompts)
        ]
        runs = {
            "after_griffin": lambda ids: new_decode.speculative_generate(target, draft, ids, tree, greedy, args.new),
            "before_griffin": lambda ids: old_decode.speculative_generate(
                old_target, old_draft, ids, old_tree, old_greedy, args.new
            ),
            "after_vanilla": lambda ids: new_decode.vanilla_generate(target, ids, greedy, args.new),
            "before_vanilla": lambda ids: old_decode.vanilla_generate(old_target, ids, old_greedy, args.new),
        }
        seconds = time_interleaved(runs, prompts, args.reps)
    medians = {name: statistics.median(v) for name, v in seconds.items()}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_identity(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "before_commit": BEFORE,
        "tree": tree.model_dump(),
        "prompts": args.prompts,
        "new_tokens": args.new,
        "reps": args.reps,
        "median_latency_s": medians,
        "griffin_after_vs_before": medians["after_griffin"] / medians["before_griffin"],
        "vanilla_after_vs_before": medians["after_vanilla"] / medians["before_vanilla"],
        "speedup_before": medians["before_vanilla"] / medians["before_griffin"],
        "speedup_after": medians["after_vanilla"] / medians["after_griffin"],
    }
    print(json.dumps(result, indent=2))
    suffix = "" if args.dtype == "bfloat16" else "-fp32"
    (OUT / f"lossless_speed{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
