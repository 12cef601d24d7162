"""The shipped SmolLM2 GRIFFIN draft on a GPU: compiled decoding (CUDA graphs) against eager, tau and speedups.

Runs the evaluation's own protocol (``pipeline.evaluate.evaluate.evaluate_dataset``: every question turn
through every method back to back, T=0 divergences located with their logit gap) on ``--device``
(default cuda), MT-Bench and HumanEval alternating, in phases run in priority order: bf16 T=0, fp32
T=0 (the lossless check: speculative must equal vanilla token for token), bf16 T=1, fp32 T=1. Each
phase decodes with four methods over one set of weights: ``griffin`` and ``vanilla`` compiled
(``decode.compile``: griffin.static), ``griffin_eager`` and ``vanilla_eager``; speedups are over the
compiled vanilla. The tree is the one ``griffin tune-tree`` picked on the GPU (``--tree``). Each
phase is time-boxed by ``--budget-s`` (the device machine is lent for minutes): a phase stops
starting questions once its share of decoding time is spent (loading and compiling come on top), and the JSON is rewritten after every question, so a
killed run still leaves what it measured. The method order rotates with the question.

    python benchmarks/gpu/gpu_decode.py --out DIR [--device cuda] [--tree 60/6/10] [--questions 8] [--budget-s 420]
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
from griffin.static import graph_counts
from griffin.target import TargetAdapter
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
# (dtype, temperature, HF baseline?, share of the budget)
PHASES = [
    ("bfloat16", 0.0, True, 0.35),
    ("float32", 0.0, False, 0.25),
    ("bfloat16", 1.0, False, 0.2),
    ("float32", 1.0, False, 0.2),
]


def parse_tree(text: str) -> TreeConfig:
    total, depth, top_k = (int(x) for x in text.split("/"))
    return TreeConfig(total_tokens=total, depth=depth, top_k=top_k)


def methods_for(target, draft, tree: TreeConfig, with_hf: bool) -> tuple[dict, TargetAdapter]:
    """griffin and vanilla compiled, their eager twins over the same weights, and HF generate;
    returns the methods and the compiled adapter."""
    compiled = TargetAdapter(target.model, target.tokenizer, name=target.name, revision=target.revision)
    compiled.compile_decoding()
    methods = {
        "griffin": local_decoder(compiled, draft, tree),
        "vanilla": local_decoder(compiled),
        "griffin_eager": local_decoder(target, draft, tree),
        "vanilla_eager": local_decoder(target),
    }
    if with_hf:
        methods["hf_generate"] = hf_decoder(target)
    return methods, compiled


def rotated(methods: dict, index: int) -> dict:
    names = list(methods)
    return {name: methods[name] for name in names[index % len(names) :] + names[: index % len(names)]}


def run_phase(
    device: str,
    dtype: str,
    temperature: float,
    tree: TreeConfig,
    with_hf: bool,
    questions: dict[str, list[dict]],
    seconds: float,
    max_new: int,
) -> dict:
    cfg = load_config(
        CONFIG,
        [
            f"target.device={device}",
            f"target.dtype={dtype}",
            f"eval.max_new_tokens={max_new}",
            f"decode.tree.total_tokens={tree.total_tokens}",
            f"decode.tree.depth={tree.depth}",
            f"decode.tree.top_k={tree.top_k}",
            "eval.tree=null",
            "target.prepack=false",  # one set of weights for both: a compiled target is not pre-packed (CPU only)
        ],
    )
    target = load_target(cfg.target, decoding=True)
    draft = load_draft_uri(DRAFT, target, cfg)
    methods, compiled = methods_for(target, draft, tree, with_hf)
    started = time.monotonic()
    _warm_up(methods, compiled, cfg, {"griffin": draft})  # captures the compiled steps, then each method once
    warm_up_s = time.monotonic() - started
    warm_graphs = graph_counts(compiled.device)  # after warm-up a request should record no CUDA graph
    deadline = time.monotonic() + seconds  # the phase's share counts decoding, not loading and compiling
    records, done = [], {name: 0 for name in questions}
    for index in range(max(len(items) for items in questions.values())):  # alternate the datasets
        for name, items in questions.items():
            if index >= len(items) or time.monotonic() > deadline:
                continue
            seeded = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"seed": cfg.eval.seed + index})})
            records += evaluate_dataset(name, [items[index]], temperature, rotated(methods, index), seeded, target)
            done[name] += 1
    graphs = graph_counts(compiled.device)
    graphs = {
        "after_warm_up": warm_graphs["recorded"],
        "recorded_while_decoding": graphs["recorded"] - warm_graphs["recorded"],
        "compiled_requests": sum(r["method"] in ("griffin", "vanilla") for r in records),
        "skipped_cudagraphs": graphs["skipped"],
    }
    print(f"[{dtype} T={temperature:g}] CUDA graphs: {graphs}", flush=True)
    report = summarize(records, list(methods), cfg, target, DRAFT) if records else {"results": {}}
    for row in records:
        row.pop("text", None)
    del target, draft, compiled, methods
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "dtype": dtype,
        "temperature": temperature,
        "warm_up_s": round(warm_up_s, 1),
        "cuda_graphs": graphs,
        "trees": {m: (tree.total_tokens, tree.depth, tree.top_k) for m in ("griffin", "griffin_eager")},
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
    tree = parse_tree(args.tree)
    result["tree"] = args.tree
    for dtype, temperature, with_hf, share in PHASES[: args.phases]:
        if time.monotonic() - start > args.wall_s:  # loading and compiling included: one device call's limit
            break
        phase_start = time.monotonic()
        phase = run_phase(args.device, dtype, temperature, tree, with_hf, questions, share * args.budget_s, args.new)
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
        "(each question turn through every method back to back). griffin and vanilla decode compiled "
        "(CUDA graphs), the _eager methods without; speedups are medians of per-turn ratios over the "
        "compiled vanilla.",
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
    parser.add_argument("--tree", default="60/6/10", help="total/depth/top_k: griffin tune-tree's pick on this GPU")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--budget-s", type=float, default=420, help="decoding seconds, shared by the phases")
    parser.add_argument("--wall-s", type=float, default=480, help="start no phase after this many seconds")
    parser.add_argument("--phases", type=int, default=len(PHASES), help="run the first N phases (a dry run: 1)")
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
