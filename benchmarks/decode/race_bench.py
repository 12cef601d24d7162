"""At T>0, a draft that runs the target's race (griffin.tree.DraftRace) against a top-k tree, and both against vanilla.

SmolLM2-135M-Instruct (``target.dtype: auto``) with a GRIFFIN draft (default the shipped one); MT-Bench
first turns, seeded (question i, seed i), ``--new`` tokens at ``--temperature``. Per tree and prompt,
interleaved in one process: vanilla, speculative with a top-k tree (the draft's race turned off), and
speculative with the race (what decodes now). All three must commit the same tokens (a seeded
request's text does not depend on the tree): checked. Reports τ and tokens/s, medians of the per-prompt
ratios. Writes race-<dtype>-<label>.{json,md}.

    python benchmarks/decode/race_bench.py [--dtype float32] [--draft DIR] [--trees 4/1/4 6/2/3] [--prompts 8] [--new 64]

In fp32 the three outputs are equal token for token; in bf16 a batched verify pass and a single step
round differently, so a race whose two leaders are that close can pick differently (docs/method.md §5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

import griffin.engine  # noqa: E402
from griffin.config import SamplingConfig, TreeConfig  # noqa: E402
from griffin.decode import speculative_generate, vanilla_generate  # noqa: E402
from griffin.offline import warm_up  # noqa: E402
from griffin.policy import SpeculationPolicy  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.data.chat import render_chat  # noqa: E402
from pipeline.evaluate.report import machine_identity  # noqa: E402
from pipeline.resources.drafts import load_draft_uri  # noqa: E402
from pipeline.resources.questions import load_questions  # noqa: E402
from pipeline.resources.targets import load_target  # noqa: E402

OUT = Path(__file__).parent
RACE = griffin.engine.DraftRace.of


def decode(mode: str, target, draft, ids, tree: TreeConfig, sampling: SamplingConfig, new: int, seed: int):
    """One decode: 'vanilla', 'topk' (speculative, the draft ranking by its own law) or 'race'."""
    if mode == "vanilla":
        return vanilla_generate(target, ids, sampling, new, seed, stop_token_ids=[])
    griffin.engine.DraftRace.of = RACE if mode == "race" else (lambda *args: None)  # type: ignore[method-assign]
    try:
        return speculative_generate(target, draft, ids, tree, sampling, new, seed, stop_token_ids=[])
    finally:
        griffin.engine.DraftRace.of = RACE  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft", default="drafts/smollm2-135m-instruct/griffin")
    parser.add_argument("--dtype", default="float32", help="target.dtype: float32, bfloat16 or auto")
    parser.add_argument("--label", default="shipped")
    parser.add_argument("--trees", nargs="+", default=["4/1/4", "6/2/3", "12/3/10", "16/5/4"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # what a 2-core replica runs beside its ingress; and steadier timings
    cfg = load_config("jobs/configs/smollm2-quick.yaml", [f"target.dtype={args.dtype}"])
    target = load_target(cfg.target, decoding=True)
    draft = load_draft_uri(args.draft, target, cfg)
    sampling = SamplingConfig(temperature=args.temperature)
    trees = {label: TreeConfig(**dict(zip(("total_tokens", "depth", "top_k"), map(int, label.split("/")))))
             for label in args.trees}  # fmt: skip
    warm_up(target, draft, SpeculationPolicy({1: next(iter(trees.values()))}))
    questions = load_questions("mt_bench", args.prompts)
    prompts = [
        torch.tensor([render_chat(target.tokenizer, [{"role": "user", "content": q["turns"][0]}])]) for q in questions
    ]
    rows = []
    for label, tree in trees.items():
        for i, ids in enumerate(prompts):
            row = {"tree": label, "prompt": i}
            outputs = {}
            for mode in ("vanilla", "topk", "race"):
                start = time.perf_counter()
                result = decode(mode, target, draft, ids, tree, sampling, args.new, seed=i)
                row[f"{mode}_tokens_per_s"] = len(result.tokens) / (time.perf_counter() - start)
                row[f"{mode}_tau"] = result.stats.acceptance_length
                outputs[mode] = result.tokens
            row["same_tokens"] = outputs["vanilla"] == outputs["topk"] == outputs["race"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = summarize(rows, trees)
    record = {"machine": machine_identity(), "date": time.strftime("%Y-%m-%d"), "args": vars(args),
              "summary": summary, "rows": rows}  # fmt: skip
    (OUT / f"race-{args.dtype}-{args.label}.json").write_text(json.dumps(record, indent=1) + "\n")
    (OUT / f"race-{args.dtype}-{args.label}.md").write_text(table(record))
    print(table(record))


def summarize(rows: list[dict], trees: dict) -> list[dict]:
    med = statistics.median
    out = []
    for label in trees:
        mine = [r for r in rows if r["tree"] == label]
        out.append({
            "tree": label,
            "tau_topk": med(r["topk_tau"] for r in mine),
            "tau_race": med(r["race_tau"] for r in mine),
            "topk_vs_vanilla": med(r["topk_tokens_per_s"] / r["vanilla_tokens_per_s"] for r in mine),
            "race_vs_vanilla": med(r["race_tokens_per_s"] / r["vanilla_tokens_per_s"] for r in mine),
            "race_vs_topk": med(r["race_tokens_per_s"] / r["topk_tokens_per_s"] for r in mine),
            "vanilla_tokens_per_s": med(r["vanilla_tokens_per_s"] for r in mine),
            "same_tokens": f"{sum(r['same_tokens'] for r in mine)}/{len(mine)}",
        })  # fmt: skip
    return out


def table(record: dict) -> str:
    args, machine = record["args"], record["machine"]
    lines = [
        f"# The draft's race at T={args['temperature']:g} vs a top-k tree ({record['date']})",
        "",
        f"Draft `{args['draft']}`, {args['prompts']} MT-Bench first turns (seed = question index), "
        f"{args['new']} tokens, target {args['dtype']}, 1 thread; per prompt interleaved: vanilla, top-k tree, race. "
        f"Medians of per-prompt ratios. Machine: {machine}.",
        "",
        "| tree | τ top-k | τ race | top-k / vanilla | race / vanilla | race / top-k | vanilla tokens/s | outputs equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in record["summary"]:
        lines.append(
            f"| {s['tree']} | {s['tau_topk']:.2f} | {s['tau_race']:.2f} | {s['topk_vs_vanilla']:.2f}x | "
            f"{s['race_vs_vanilla']:.2f}x | {s['race_vs_topk']:.2f}x | {s['vanilla_tokens_per_s']:.1f} | "
            f"{s['same_tokens']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
