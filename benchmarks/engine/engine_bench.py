"""The batching engine on the real target: aggregate tokens/s by batch size, speculative vs plain rows.

SmolLM2-135M-Instruct with the shipped GRIFFIN draft, on this CPU, MT-Bench first turns, T=0. For
each batch size B, the same B prompts decode (a) through ``speculative_generate`` one after another
(today's batch-1 path), (b) together through ``griffin.engine`` with the tree, (c) together with
plain rows (the engine with speculation off); the three are interleaved per repeat, medians
reported. Every output is checked against (a) token for token. Writes engine.{json,md}
(``--dtype float32`` -> engine-fp32.*).

    python benchmarks/engine/engine_bench.py [--dtype float32] [--batches 1 2 4 8] [--new 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from griffin.config import SamplingConfig, TreeConfig
from griffin.decode import speculative_generate
from griffin.policy import SpeculationPolicy
from griffin.request import DecodeRequest
from griffin.offline import generate_batch
from pipeline.config import load_config
from pipeline.data.chat import render_chat
from pipeline.evaluate.report import machine_identity
from pipeline.resources.drafts import load_draft_uri
from pipeline.resources.questions import load_questions
from pipeline.resources.targets import load_target

OUT = Path(__file__).parent
DRAFT = "drafts/smollm2-135m-instruct/griffin"


def prompts(target, n: int) -> list[list[int]]:
    questions = load_questions("mt_bench", n)
    return [render_chat(target.tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in questions]


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def one_batch(target, draft, tree, batch_prompts, new):
    greedy = SamplingConfig()
    sequential = lambda: [
        speculative_generate(target, draft, torch.tensor([p]), tree, greedy, new, stop_token_ids=[]).tokens
        for p in batch_prompts
    ]
    requests = lambda: [DecodeRequest(p, greedy, new, stop_token_ids=[]) for p in batch_prompts]
    engine = lambda policy: [r.tokens for r in generate_batch(target, draft, requests(), policy)]
    runs = {
        "sequential": sequential,
        "engine_tree": lambda: engine(SpeculationPolicy({1: tree})),
        "engine_plain": lambda: engine(SpeculationPolicy({1: None})),
    }
    seconds, outputs = {}, {}
    for name, fn in runs.items():
        seconds[name], outputs[name] = timed(fn)
    return seconds, outputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    cfg = load_config("jobs/configs/smollm2-quick.yaml", [f"target.dtype={args.dtype}"])
    target = load_target(cfg.target, decoding=True)
    draft = load_draft_uri(DRAFT, target, cfg)
    tree = TreeConfig(total_tokens=12, depth=3, top_k=10)
    pool = prompts(target, max(args.batches))
    rows = []
    for batch in args.batches:
        samples = {"sequential": [], "engine_tree": [], "engine_plain": []}
        for _ in range(args.reps):
            seconds, outputs = one_batch(target, draft, tree, pool[:batch], args.new)
            for name in samples:
                assert outputs[name] == outputs["sequential"], f"{name} changed an output at batch {batch}"
                samples[name].append(batch * args.new / seconds[name])
        row = {"batch": batch, **{f"{k}_tok_s": statistics.median(v) for k, v in samples.items()}}
        row["tree_vs_sequential"] = row["engine_tree_tok_s"] / row["sequential_tok_s"]
        row["plain_vs_sequential"] = row["engine_plain_tok_s"] / row["sequential_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    suffix = "" if args.dtype == "bfloat16" else "-fp32"
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_identity(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "tree": tree.model_dump(),
        "new_tokens": args.new,
        "reps": args.reps,
        "rows": rows,
    }
    (OUT / f"engine{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
