"""Replayed τ against decoded τ, and what each costs: the evidence behind tune-tree's replay.

For the shipped GRIFFIN draft on SmolLM2-135M-Instruct (``target.dtype: auto``), on tune-tree's
calibration prompts (the last MT-Bench and HumanEval questions): per tree of a grid, per prompt,
real T=0 speculative decoding and the draft-only replay (``griffin.replay``) of the same prompt,
interleaved. Records whether every round's accepted length agrees, τ both ways, and the seconds
each took; and how far τ measured on 2 prompts (what tune-tree used to decode) strays from τ on all.
Writes benchmarks/tune_tree/replay.{json,md}.

    python benchmarks/tune_tree/replay_bench.py [--prompts 8] [--new 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from griffin.config import TreeConfig  # noqa: E402
from griffin.decode import speculative_generate  # noqa: E402
from griffin.results import acceptance_length as tau  # noqa: E402
from griffin.replay import GREEDY, decode_reference, replay_decode  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.evaluate.report import hardware  # noqa: E402
from pipeline.resources.drafts import load_draft_uri  # noqa: E402
from pipeline.resources.targets import load_target  # noqa: E402
from pipeline.evaluate.tune import DEPTHS, calibration_prompts  # noqa: E402

OUT = Path(__file__).parent
DRAFT = "drafts/smollm2-135m-instruct/griffin"
TREES = ["4/2/2", "6/2/2", "6/3/2", "8/3/3", "12/3/10", "16/3/8", "16/5/4", "24/4/6"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    cfg = load_config("jobs/configs/smollm2-quick.yaml", ["eval.datasets=[mt_bench, humaneval]"])
    target = load_target(cfg.target, decoding=True)
    draft = load_draft_uri(DRAFT, target, cfg)
    prompts = [ids.to(target.device) for ids in calibration_prompts(cfg, target.tokenizer, args.prompts)]
    speculative_generate(target, draft, prompts[0], TreeConfig(total_tokens=6, depth=2, top_k=2), GREEDY, 8)  # warm-up
    start = time.perf_counter()
    references = [decode_reference(target, ids, args.new, max(DEPTHS), draft.cfg.feature_layers) for ids in prompts]
    reference_s = time.perf_counter() - start

    rows = []
    for name in TREES:
        total, depth, top_k = (int(x) for x in name.split("/"))
        tree = TreeConfig(total_tokens=total, depth=depth, top_k=top_k)
        real, replayed, real_s, replay_s, agree = [], [], 0.0, 0.0, 0
        for ids, reference in zip(prompts, references):  # interleaved per prompt
            start = time.perf_counter()
            decoded = speculative_generate(target, draft, ids, tree, GREEDY, args.new)
            real_s += time.perf_counter() - start
            start = time.perf_counter()
            replay = replay_decode(draft, reference, tree)
            replay_s += time.perf_counter() - start
            assert decoded.tokens == reference.continuation[: reference.length]
            real.append(decoded.stats.accepted_per_round)
            replayed.append(replay.accepted_per_round)
            agree += decoded.stats.accepted_per_round == replay.accepted_per_round
        flat_real = [a for prompt in real for a in prompt]
        two = [a for prompt in real[:2] for a in prompt]
        rows.append(
            {
                "tree": name,
                "tau_decoded": tau(flat_real),
                "tau_replayed": tau([a for p in replayed for a in p]),
                "prompts_identical": agree,
                "prompts": len(prompts),
                "tau_per_prompt": [round(tau(p), 3) for p in real],
                "tau_first_two_prompts": tau(two),
                "decode_s": real_s,
                "replay_s": replay_s,
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    OUT.mkdir(exist_ok=True)
    result = {
        "target": target.name,
        "dtype": str(target.dtype),
        "draft": DRAFT,
        "hardware": hardware(),
        "prompts": len(prompts),
        "max_new_tokens": args.new,
        "reference_s": reference_s,
        "trees": rows,
    }
    (OUT / "replay.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"{target.name}, {target.dtype}, draft `{DRAFT}`, {len(prompts)} calibration prompts x {args.new} "
        f"tokens at T=0; {result['hardware']['cpu_model']} ({result['hardware']['cpu_capability']}), "
        f"{result['hardware']['torch_threads']} threads. The continuations (vanilla decode + one forward "
        f"per prompt) took {reference_s:.1f} s.",
        "",
        "| tree | τ decoded | τ replayed | prompts with every round identical | τ on the first 2 prompts "
        "| decode s | replay s | replay / decode |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['tree']} | {r['tau_decoded']:.3f} | {r['tau_replayed']:.3f} | {r['prompts_identical']} / "
        f"{r['prompts']} | {r['tau_first_two_prompts']:.3f} | {r['decode_s']:.1f} | {r['replay_s']:.1f} | "
        f"{r['replay_s'] / r['decode_s']:.2f} |"
        for r in rows
    ]
    (OUT / "replay.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
