"""The shipped SmolLM2 GRIFFIN draft on a GPU: tau and speedup against vanilla and HF ``generate``.

Runs the evaluation's own protocol (``pipeline.evaluate.evaluate.evaluate_dataset``: every question turn
through every method back to back, T=0 divergences located with their logit gap) on
``--device`` (default cuda), with several trees at once, in phases run in priority order:
fp32 T=0 (the lossless check: speculative must equal vanilla token for token), bf16 T=0, fp32 T=1.
Each phase is time-boxed by ``--budget-s`` (the device machine is lent for minutes): a phase stops
starting questions once its share is spent, and the JSON is rewritten after every question, so a
killed run still leaves what it measured. The method order rotates with the question.

    python benchmarks/gpu/gpu_decode.py --out DIR [--device cuda] [--questions 8] [--budget-s 420]
    python benchmarks/gpu/gpu_decode.py --render DIR/gpu_decode.json   # -> benchmarks/gpu/gpu_decode.{json,md,png}
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

from griffin.config import TreeConfig
from pipeline.config import load_config
from pipeline.evaluate.evaluate import _warm_up, evaluate_dataset
from pipeline.evaluate.methods import hf_decoder, local_decoder
from pipeline.evaluate.report import hardware, summarize
from pipeline.resources.drafts import load_draft_uri
from pipeline.resources.questions import load_questions
from pipeline.resources.targets import load_target

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "jobs" / "configs" / "smollm2-long.yaml"
DRAFT = "drafts/smollm2-135m-instruct/griffin"
# (dtype, temperature, trees, HF baseline?, share of the budget). The first tree is "griffin";
# 16/5/4 is the CPU config's, 60/6/10 EAGLE-2's GPU default, 96/8/12 a deeper, wider one.
TREES = {"16/5/4": (16, 5, 4), "60/6/10": (60, 6, 10), "96/8/12": (96, 8, 12)}
PHASES = [
    ("float32", 0.0, ["60/6/10", "16/5/4", "96/8/12"], True, 0.5),
    ("bfloat16", 0.0, ["60/6/10", "16/5/4"], False, 0.25),
    ("float32", 1.0, ["60/6/10"], False, 0.25),
]


def tree(name: str) -> TreeConfig:
    total, depth, top_k = TREES[name]
    return TreeConfig(total_tokens=total, depth=depth, top_k=top_k)


def methods_for(target, draft, trees: list[str], with_hf: bool) -> dict:
    """griffin (first tree), griffin_<tree> for the others, vanilla, and HF generate."""
    methods = {"griffin": local_decoder(target, draft, tree(trees[0]))}
    methods.update({f"griffin_{name}": local_decoder(target, draft, tree(name)) for name in trees[1:]})
    methods["vanilla"] = local_decoder(target)
    if with_hf:
        methods["hf_generate"] = hf_decoder(target)
    return methods


def rotated(methods: dict, index: int) -> dict:
    names = list(methods)
    return {name: methods[name] for name in names[index % len(names) :] + names[: index % len(names)]}


def run_phase(
    device: str,
    dtype: str,
    temperature: float,
    trees: list[str],
    with_hf: bool,
    questions: dict[str, list[dict]],
    deadline: float,
    max_new: int,
) -> dict:
    primary = TREES[trees[0]]
    cfg = load_config(
        CONFIG,
        [
            f"target.device={device}",
            f"target.dtype={dtype}",
            f"eval.max_new_tokens={max_new}",
            f"decode.tree.total_tokens={primary[0]}",
            f"decode.tree.depth={primary[1]}",
            f"decode.tree.top_k={primary[2]}",
            "eval.tree=null",
        ],
    )
    target = load_target(cfg.target, decoding=True)
    draft = load_draft_uri(DRAFT, target, cfg)
    methods = methods_for(target, draft, trees, with_hf)
    _warm_up(methods, target, cfg)  # the evaluation's own: kernels, caches, allocator
    records, done = [], {name: 0 for name in questions}
    for index in range(max(len(items) for items in questions.values())):  # alternate the datasets
        for name, items in questions.items():
            if index >= len(items) or time.monotonic() > deadline:
                continue
            seeded = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"seed": cfg.eval.seed + index})})
            records += evaluate_dataset(name, [items[index]], temperature, rotated(methods, index), seeded, target)
            done[name] += 1
    report = summarize(records, list(methods), cfg, target, DRAFT) if records else {"results": {}}
    for row in records:
        row.pop("text", None)
    del target, draft
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "dtype": dtype,
        "temperature": temperature,
        "trees": {f"griffin_{n}" if i else "griffin": TREES[n] for i, n in enumerate(trees)},
        "questions_done": done,
        "results": report["results"],
        "records": records,
    }


def run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    questions = {name: load_questions(name, args.questions) for name in ("mt_bench", "humaneval")}
    result = {
        "hardware": hardware(),
        "torch": torch.__version__,
        "max_new_tokens": args.new,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "phases": [],
    }
    start = time.monotonic()
    for dtype, temperature, trees, with_hf, share in PHASES:
        deadline = time.monotonic() + share * args.budget_s
        if time.monotonic() - start > args.budget_s:
            break
        phase_start = time.monotonic()
        phase = run_phase(args.device, dtype, temperature, trees, with_hf, questions, deadline, args.new)
        phase["seconds"] = round(time.monotonic() - phase_start, 1)
        result["phases"].append(phase)
        (out / "gpu_decode.json").write_text(json.dumps(result, indent=1, default=str))
        print(f"{dtype} T={temperature:g}: {phase['questions_done']} in {phase['seconds']} s", flush=True)
    print(render(result))


def render(result: dict) -> str:
    """The markdown table: per phase x dataset, each method's tau, median tokens/s and speedups."""
    lines = [
        f"# The shipped SmolLM2 GRIFFIN draft on {result['device_name']}",
        "",
        f"torch {result['torch']}, {result['max_new_tokens']} new tokens, in-process, evaluation protocol "
        "(each question turn through every method back to back). Speedups are medians of per-turn ratios.",
        "",
    ]
    for phase in result["phases"]:
        for key, group in phase["results"].items():
            trees = phase["trees"]
            lines += [
                f"## {phase['dtype']}, {key}",
                "",
                "| method | tree | generations | tau | median tokens/s | vs vanilla | T=0 mismatches |",
                "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
            ]
            mismatches = Counter(m["method"] for m in group["mismatches"])
            for method, entry in group["methods"].items():
                shape = "/".join(map(str, trees[method])) if method in trees else "-"
                tau = f"{entry['tau']:.2f}" if "tau" in entry else "-"
                speedup = entry.get("speedup_vs_vanilla")
                lines.append(
                    f"| {method} | {shape} | {entry['generations']} | {tau} | {entry['tokens_per_s_median']:.1f} "
                    f"| {f'{speedup:.2f}x' if speedup else '-'} | {mismatches.get(method, 0)} |"
                )
            if "hf_generate" in group["speedup"]:
                lines += [
                    "",
                    f"GRIFFIN ({'/'.join(map(str, trees['griffin']))}) over HF generate: "
                    f"{group['speedup']['hf_generate']:.2f}x",
                ]
            ties = [m for m in group["mismatches"] if m["near_tie"]]
            lines += [
                "",
                f"Mismatches at near-ties: {len(ties)} of {len(group['mismatches'])}"
                + (f" (largest gap {max(m['gap'] for m in ties):.3f})" if ties else ""),
                "",
            ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Median tokens/s per method, one panel per phase x dataset; a method keeps its colour everywhere."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"{p['dtype']} {key}", group) for p in result["phases"] for key, group in p["results"].items()]
    methods = list(dict.fromkeys(m for _, group in panels for m in group["methods"]))
    colours = {m: plt.cm.tab10(i) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.6), sharey=True)
    for ax, (title, group) in zip(axes, panels):
        names = list(group["methods"])
        ax.bar(
            range(len(names)),
            [group["methods"][m]["tokens_per_s_median"] for m in names],
            color=[colours[m] for m in names],
        )
        ax.set_xticks([])
        ax.set_title(title, fontsize=9)
    axes[0].set_ylabel("median tokens/s")
    fig.legend(
        [plt.Rectangle((0, 0), 1, 1, color=colours[m]) for m in methods],
        methods,
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        fontsize=8,
    )
    fig.suptitle(f"Shipped SmolLM2 GRIFFIN draft on {result['device_name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "outputs" / "gpu_decode"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--budget-s", type=float, default=420)
    parser.add_argument("--render", help="write benchmarks/gpu/gpu_decode.md from this gpu_decode.json and stop")
    args = parser.parse_args()
    if args.render:
        result = json.loads(Path(args.render).read_text())
        here = Path(__file__).parent
        (here / "gpu_decode.json").write_text(json.dumps(result, indent=1))
        (here / "gpu_decode.md").write_text(render(result))
        plot(result, here / "gpu_decode.png")
        return
    run(args)


if __name__ == "__main__":
    main()
