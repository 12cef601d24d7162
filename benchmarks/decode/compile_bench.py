"""Compiled decoding (``decode.compile=on``, griffin.static) against eager decoding, on this CPU.

SmolLM2-135M-Instruct with the shipped GRIFFIN draft, loaded as decoding loads them (eager: pre-packed
linears; compiled: plain ones, which inductor's freezing packs); MT-Bench first turns. Per prompt, interleaved: vanilla eager, vanilla compiled, GRIFFIN
eager, GRIFFIN compiled (same seed each), after an untimed warm-up that captures the compiled
steps (griffin.offline.warm_up). Every compiled output is checked against its eager twin token for
token. Medians of tokens/s and the per-prompt ratios. Writes compile-<dtype>.{json,md}.

    python benchmarks/decode/compile_bench.py [--dtype float32] [--prompts 8] [--new 96] [--temperature 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from griffin.config import SamplingConfig, TreeConfig
from griffin.decode import speculative_generate, vanilla_generate
from griffin.policy import SpeculationPolicy
from griffin.offline import warm_up
from pipeline.config import load_config
from pipeline.data.chat import render_chat
from griffin.decode import first_divergence
from pipeline.evaluate.report import machine_identity
from pipeline.resources.drafts import load_draft_uri
from pipeline.resources.targets import load_target

OUT = Path(__file__).parent
DRAFT = "drafts/smollm2-135m-instruct/griffin"
METHODS = ["vanilla_eager", "vanilla_compiled", "griffin_eager", "griffin_compiled"]


def prompts(tokenizer, n: int) -> list[list[int]]:
    from pipeline.resources.questions import load_questions

    return [render_chat(tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in load_questions("mt_bench", n)]


def decoders(cfg, tree, sampling, new):
    """(name -> fn(prompt ids, seed) -> GenerationResult, the eager target); eager and compiled hold
    their own weights."""
    runs, targets = {}, {}
    for mode in ("eager", "compiled"):
        target = load_target(cfg.target, decoding=True, compile="on" if mode == "compiled" else "off")
        draft = load_draft_uri(DRAFT, target, cfg)
        warm_up(target, None, SpeculationPolicy({1: None}))
        warm_up(target, draft, SpeculationPolicy({1: tree}))

        def vanilla(ids, seed, t=target):
            return vanilla_generate(t, ids, sampling, new, seed, stop_token_ids=[])

        def griffin(ids, seed, t=target, d=draft):
            return speculative_generate(t, d, ids, tree, sampling, new, seed, stop_token_ids=[])

        runs[f"vanilla_{mode}"], runs[f"griffin_{mode}"] = vanilla, griffin
        targets[mode] = target
    return runs, targets["eager"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    cfg = load_config("jobs/configs/smollm2-quick.yaml", [f"target.dtype={args.dtype}"])
    tree, sampling = cfg.decode.tree, SamplingConfig(temperature=args.temperature)
    started = time.perf_counter()
    runs, eager = decoders(cfg, tree, sampling, args.new)
    warm_s = time.perf_counter() - started
    rates = {name: [] for name in METHODS}
    mismatches = []
    for i, prompt in enumerate(prompts(eager.tokenizer, args.prompts)):
        ids = torch.tensor([prompt])
        outputs = {}
        for name in METHODS:
            start = time.perf_counter()
            outputs[name] = runs[name](ids, i).tokens
            rates[name].append(len(outputs[name]) / (time.perf_counter() - start))
        for m in ("vanilla", "griffin"):
            compiled, reference = outputs[f"{m}_compiled"], outputs[f"{m}_eager"]
            if compiled != reference:  # fp32 must not differ; bf16 only at a measured near-tie
                where = first_divergence(eager, prompt, compiled, reference)
                mismatches.append({"prompt": i, "method": m, **where})
    medians = {name: statistics.median(r) for name, r in rates.items()}
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(rates[a], rates[b]))  # noqa: E731
    result = {
        "machine": machine_identity(),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "temperature": args.temperature,
        "prompts": args.prompts,
        "new_tokens": args.new,
        "tree": tree.model_dump(),
        "warm_up_seconds": round(warm_s, 1),
        "tokens_per_s_median": {k: round(v, 2) for k, v in medians.items()},
        "compiled_over_eager": {
            "vanilla": round(ratio("vanilla_compiled", "vanilla_eager"), 3),
            "griffin": round(ratio("griffin_compiled", "griffin_eager"), 3),
        },
        "griffin_over_vanilla": {
            "eager": round(ratio("griffin_eager", "vanilla_eager"), 3),
            "compiled": round(ratio("griffin_compiled", "vanilla_compiled"), 3),
        },
        "outputs_identical": not mismatches,
        "mismatches_all_near_ties": all(m["near_tie"] for m in mismatches),
        "mismatches": mismatches,
    }
    name = f"compile-{args.dtype}"
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (OUT / f"{name}.md").write_text(table(result))
    print(table(result))


def table(r: dict) -> str:
    m, c, g = r["tokens_per_s_median"], r["compiled_over_eager"], r["griffin_over_vanilla"]
    machine = f"{r['machine']['cpu_model']}, {r['machine']['cpu_capability']}, {r['machine']['torch_threads']} threads"
    return (
        f"# Compiled vs eager decoding, {r['dtype']}, T={r['temperature']} ({r['date']}, {machine})\n\n"
        f"SmolLM2-135M-Instruct + the shipped GRIFFIN draft (eager: pre-packed linears; compiled: inductor with "
        f"freezing), {r['prompts']} MT-Bench prompts, "
        f"{r['new_tokens']} tokens, tree {TreeConfig(**r['tree']).label}; "
        f"interleaved per prompt, medians; warm-up (compiling) {r['warm_up_seconds']} s; "
        f"outputs identical: {r['outputs_identical']}"
        + (
            ""
            if r["outputs_identical"]
            else f" ({len(r['mismatches'])} differ; all at near-ties: {r['mismatches_all_near_ties']})"
        )
        + ".\n\n"
        "| method | eager tok/s | compiled tok/s | compiled / eager |\n|---|---|---|---|\n"
        f"| vanilla | {m['vanilla_eager']} | {m['vanilla_compiled']} | {c['vanilla']}x |\n"
        f"| GRIFFIN | {m['griffin_eager']} | {m['griffin_compiled']} | {c['griffin']}x |\n"
        f"| GRIFFIN / vanilla | {g['eager']}x | {g['compiled']}x | |\n"
    )


if __name__ == "__main__":
    main()
