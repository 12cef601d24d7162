"""A lone request through the batching engine vs the batch-1 decode loops it replaced, in one process.

The baseline is the ``griffin`` package as of commit ``BASELINE`` (the last with the batch-1 loops),
extracted from git into a temporary folder under the name ``griffin_batch1`` (imports rewritten), so
both run interleaved in one process on one machine: SmolLM2-135M-Instruct with the shipped GRIFFIN
draft, MT-Bench first turns, T=0, its tree 12/3/10, plus vanilla decoding. Each loads its own copy of
the target and draft (the same weights). Outputs are checked equal. Writes lone_request[-fp32].json.

    python benchmarks/engine/lone_request.py [--dtype float32] [--prompts 8] [--new 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

BASELINE = "0139fab"  # main before the batching engine
OUT = Path(__file__).parent
DRAFT = "drafts/smollm2-135m-instruct/griffin"


def baseline_package(folder: Path, commit: str = BASELINE, name: str = "griffin_batch1") -> str:
    """Extract griffin/ at ``commit`` into folder/``name`` with its own imports renamed."""
    archive = subprocess.run(["git", "archive", commit, "griffin"], check=True, capture_output=True).stdout
    tarfile.open(fileobj=io.BytesIO(archive)).extractall(folder, filter="data")
    package = folder / name
    (folder / "griffin").rename(package)
    for path in package.rglob("*.py"):
        path.write_text(re.sub(r"\bgriffin\.", f"{name}.", path.read_text()))
    sys.path.insert(0, str(folder))
    return name


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    from griffin.config import SamplingConfig, TreeConfig
    from pipeline.config import load_config
    from pipeline.data.chat import render_chat
    from pipeline.evaluate.report import machine_identity
    from pipeline.resources.drafts import load_draft_uri
    from pipeline.resources.questions import load_questions
    from pipeline.resources.targets import load_target

    cfg = load_config("jobs/configs/smollm2-quick.yaml", [f"target.dtype={args.dtype}"])
    new_decode = importlib.import_module("griffin.decode")
    target = load_target(cfg.target, decoding=True)
    draft = load_draft_uri(DRAFT, target, cfg)
    with tempfile.TemporaryDirectory() as folder:
        old = baseline_package(Path(folder))
        old_decode = importlib.import_module(f"{old}.decode")
        old_config = importlib.import_module(f"{old}.config")
        old_target, old_draft = old_models(old, target, draft)
        greedy, tree = SamplingConfig(), TreeConfig(total_tokens=12, depth=3, top_k=10)
        old_greedy, old_tree = old_config.SamplingConfig(), old_config.TreeConfig(**tree.model_dump())
        prompts = [
            torch.tensor([render_chat(target.tokenizer, [{"role": "user", "content": q["turns"][0]}])])
            for q in load_questions("mt_bench", args.prompts)
        ]
        runs = {
            "engine_griffin": lambda ids: new_decode.speculative_generate(target, draft, ids, tree, greedy, args.new),
            "batch1_griffin": lambda ids: old_decode.speculative_generate(
                old_target, old_draft, ids, old_tree, old_greedy, args.new
            ),
            "engine_vanilla": lambda ids: new_decode.vanilla_generate(target, ids, greedy, args.new),
            "batch1_vanilla": lambda ids: old_decode.vanilla_generate(old_target, ids, old_greedy, args.new),
        }
        seconds = time_interleaved(runs, prompts, args.reps)
    medians = {name: statistics.median(v) for name, v in seconds.items()}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_identity(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "baseline_commit": BASELINE,
        "tree": tree.model_dump(),
        "prompts": args.prompts,
        "new_tokens": args.new,
        "reps": args.reps,
        "median_latency_s": medians,
        "griffin_engine_vs_batch1": medians["engine_griffin"] / medians["batch1_griffin"],
        "vanilla_engine_vs_batch1": medians["engine_vanilla"] / medians["batch1_vanilla"],
    }
    print(json.dumps(result, indent=2))
    suffix = "" if args.dtype == "bfloat16" else "-fp32"
    (OUT / f"lone_request{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")


def time_interleaved(runs: dict, prompts: list, reps: int) -> dict[str, list[float]]:
    """Each prompt through every run, in an order rotated per repetition, ``reps`` times after a warm-up;
    the seconds of each call by run. Every run must give the same tokens (T=0: the outputs are equal)."""
    seconds = {name: [] for name in runs}
    for rep in range(reps + 1):  # repetition 0 warms up
        for ids in prompts:
            names = list(runs)[rep % len(runs) :] + list(runs)[: rep % len(runs)]
            outputs = {}
            for name in names:
                start = time.perf_counter()
                outputs[name] = runs[name](ids).tokens
                if rep:
                    seconds[name].append(time.perf_counter() - start)
            assert len({tuple(tokens) for tokens in outputs.values()}) == 1, f"outputs differ: {outputs}"
    return seconds


def old_models(package: str, target, draft):
    """The baseline's own TargetAdapter over ``target``'s (pre-packed) model, and the draft loaded and
    pre-packed by the baseline's code: the same weights, the baseline's classes."""
    target_mod = importlib.import_module(f"{package}.target")
    checkpoint = importlib.import_module(f"{package}.checkpoint")
    old_target = target_mod.TargetAdapter(target.model, target.tokenizer, name=target.name)
    old_target.packed = target.packed
    old_draft = checkpoint.load_draft(DRAFT, old_target, dtype=draft.param_dtype)
    old_draft.prepack()
    return old_target, old_draft


if __name__ == "__main__":
    main()
