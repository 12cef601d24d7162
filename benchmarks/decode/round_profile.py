"""Where one speculative decoding round spends its time on this CPU.

Runs ``speculative_generate`` with a trained draft on MT-Bench prompts under ``torch.profiler`` and
splits the wall time of the rounds by the named ranges the decode loop records
(``griffin.draft_tree`` with its ``catch_up`` / ``level_step`` / ``head_topk`` / ``assemble`` parts,
``griffin.verify_forward``, ``griffin.accept``, ``griffin.commit``), plus the top aten ops inside the
target's verify forward. Writes benchmarks/decode/round_profile.json and round_profile.md.

    python benchmarks/decode/round_profile.py --draft outputs/smollm2-full-griffin/train/best \
        [--tree 16,5,4] [--prompts 4] [--new 64] [--dtype auto|bfloat16|float32]

``--dtype auto`` (the default) is what ``target.dtype: auto`` picks here: bf16 where the CPU runs it
natively, fp32 elsewhere. The files are named by dtype: round_profile[-fp32].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from griffin.config import SamplingConfig, TreeConfig  # noqa: E402
from griffin.decode import speculative_generate  # noqa: E402
from griffin.target import TargetAdapter  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.data.chat import render_chat  # noqa: E402
from pipeline.resources.drafts import load_draft_uri  # noqa: E402
from pipeline.resources.questions import load_questions  # noqa: E402

OUT = Path(__file__).parent
RANGES = (
    "griffin.draft_tree",
    "griffin.draft.catch_up",
    "griffin.draft.level_step",
    "griffin.draft.head_topk",
    "griffin.draft.assemble",
    "griffin.verify_forward",
    "griffin.accept",
    "griffin.commit",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft", required=True)
    parser.add_argument("--tree", default="16,5,4", help="total_tokens,depth,top_k")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    args = parser.parse_args()
    total, depth, top_k = (int(x) for x in args.tree.split(","))
    tree = TreeConfig(total_tokens=total, depth=depth, top_k=top_k)
    target = TargetAdapter.from_pretrained("smollm2-135m-instruct", dtype=args.dtype)
    stem = "round_profile" if target.dtype == torch.bfloat16 else "round_profile-fp32"
    packed = target.prepack()
    draft = load_draft_uri(args.draft, target, load_config("jobs/configs/smollm2-quick.yaml"))  # packed like the target
    questions = [q["turns"][0] for q in load_questions("mt_bench")[-args.prompts :]]
    prompts = [torch.tensor([render_chat(target.tokenizer, [{"role": "user", "content": q}])]) for q in questions]
    speculative_generate(target, draft, prompts[0], tree, SamplingConfig(), 8)  # warm-up
    rounds, wall = 0, 0.0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for ids in prompts:
            stats = speculative_generate(target, draft, ids, tree, SamplingConfig(), args.new).stats
            rounds += stats.rounds
            wall += stats.draft_time + stats.verify_time
    per_range: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.key in RANGES:
            per_range[event.key] += event.cpu_time_total / 1e3  # ms
    ops = sorted(
        ((e.key, e.self_cpu_time_total / 1e3) for e in prof.key_averages() if not e.key.startswith("griffin.")),
        key=lambda x: -x[1],
    )[:12]
    result = {
        "tree": tree.model_dump(),
        "dtype": str(target.dtype),
        "prepacked": packed,
        "rounds": rounds,
        "round_ms": 1e3 * wall / rounds,
        "ms_per_round": {k: per_range[k] / rounds for k in RANGES},
        "top_self_ops_ms_per_round": {k: v / rounds for k, v in ops},
    }
    (OUT / f"{stem}.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"{target.dtype}, tree {total}/{depth}/{top_k}, {rounds} rounds over {args.prompts} MT-Bench prompts, "
        f"{result['round_ms']:.1f} ms per round (timed, profiler on).",
        "",
        "| range | ms per round | share of the round |",
        "|---|---|---|",
    ]
    for key in RANGES:
        ms = result["ms_per_round"][key]
        lines.append(f"| {key} | {ms:.2f} | {ms / result['round_ms']:.0%} |")
    lines += ["", "| aten op (self time, whole round) | ms per round |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in result["top_self_ops_ms_per_round"].items()]
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
