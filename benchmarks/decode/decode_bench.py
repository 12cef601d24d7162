"""Decoding benchmark: our vanilla decoding vs HF generate, and tree-verify cost vs one decode step.

Real target (SmolLM2-135M-Instruct, CPU, bf16 or ``--dtype float32``). Three decoders, interleaved per prompt in one
process: ours with the target's linears pre-packed for oneDNN (``TargetAdapter.prepack``, what
serve and eval use), ours on plain weights, and HF ``generate`` on a stock copy of the model. We
report medians of per-prompt ratios. The verify-cost part times the engine's 16- and 60-token verify phase
against a single-token one, interleaved, on both weight layouts.
Writes benchmarks/decode/decode.{json,md,png} (bf16) or decode-fp32.{json,md,png}.

    python benchmarks/decode/decode_bench.py [--dtype bfloat16|float32] [--prompts 8] [--new 64] [--reps 15]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from griffin.config import SamplingConfig, TreeConfig
from griffin.decode import vanilla_generate
from griffin.policy import SpeculationPolicy
from griffin.offline import verify_cost
from griffin.target import TargetAdapter
from pipeline.data.chat import render_chat
from pipeline.resources.questions import load_questions

OUT = Path(__file__).parent


def prompts(target, n):
    lines = load_questions("mt_bench", n)
    return [torch.tensor([render_chat(target.tokenizer, [{"role": "user", "content": q["turns"][0]}])]) for q in lines]


def time_it(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench_generate(packed, plain, ids_list, new_tokens):
    rows = []
    greedy = SamplingConfig()
    for i, ids in enumerate(ids_list):
        runs = {
            "ours": lambda: vanilla_generate(packed, ids, greedy, new_tokens, stop_token_ids=[]).tokens,
            "ours_plain": lambda: vanilla_generate(plain, ids, greedy, new_tokens, stop_token_ids=[]).tokens,
            "hf": lambda: plain.model.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )[0, ids.shape[1] :].tolist(),
        }
        order = list(runs)[i % 3 :] + list(runs)[: i % 3]  # rotate who goes first
        seconds, tokens = {}, {}
        for name in order:
            seconds[name], tokens[name] = time_it(runs[name])
        rows.append(
            {
                "prompt_len": ids.shape[1],
                **{f"{n}_tok_s": new_tokens / seconds[n] for n in runs},
                "ratio": seconds["hf"] / seconds["ours"],
                "ratio_plain": seconds["hf"] / seconds["ours_plain"],
                "same_tokens_plain_hf": tokens["ours_plain"] == tokens["hf"],
                "same_tokens_packed_hf": tokens["ours"] == tokens["hf"],
            }
        )
    return rows


def bench_verify(targets, ids, reps):
    """Per weight layout: a 16- and a 60-token verify vs one step (a 1-token verify), each the engine's
    verify phase (``griffin.offline.verify_cost``: chains of N tokens after the prompt, sizes
    interleaved)."""
    policy = SpeculationPolicy({1: TreeConfig(total_tokens=60, depth=6, top_k=10)})
    seconds = {name: verify_cost(t, None, policy, ids[0].tolist(), (1, 16, 60), reps, 6) for name, t in targets.items()}
    rows = []
    for rep in range(reps):
        row = {}
        for name, timings in seconds.items():
            row[f"{name}_step_ms"] = timings[1][rep] * 1e3
            for n in (16, 60):
                row[f"{name}_verify{n}_ms"] = timings[n][rep] * 1e3
                row[f"{name}_verify{n}_over_step"] = timings[n][rep] / timings[1][rep]
        rows.append(row)
    return rows


def bench_layouts(target, reps):
    """oneDNN's packed layout is chosen for a batch size (``griffin.target.LAYOUT_BATCH``): the median ms
    of the target's LM head and one MLP up-projection at M rows, on plain weights and on layouts packed
    for batch 1 and 16, interleaved."""
    weights = {
        "lm_head": target.head_weight.detach(),
        "mlp_up": target.model.model.layers[0].mlp.up_proj.weight.detach(),
    }
    rows = {}
    for name, w in weights.items():
        layouts = {f"packed_b{b}": torch.ops.mkldnn._reorder_linear_weight(w, b) for b in (1, 16)}
        for m in (1, 2, 8, 16, 32):
            x = torch.randn(m, w.shape[1], dtype=w.dtype)
            runs = {
                "plain": lambda: torch.nn.functional.linear(x, w),
                **{
                    k: (lambda p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
                    for k, p in layouts.items()
                },
            }
            times = {k: [] for k in runs}
            with torch.inference_mode():
                for rep in range(reps + 1):  # repetition 0 warms up
                    for k, fn in runs.items():
                        seconds, _ = time_it(fn)
                        if rep:
                            times[k].append(seconds * 1e3)
            rows[f"{name}_M{m}"] = {k: statistics.median(v) for k, v in times.items()}
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    stem = "decode" if args.dtype == "bfloat16" else "decode-fp32"
    packed = TargetAdapter.from_pretrained("smollm2-135m-instruct", dtype=args.dtype)
    assert packed.prepack(), f"this CPU has no oneDNN {args.dtype}: the packed decoder cannot be measured here"
    plain = TargetAdapter.from_pretrained("smollm2-135m-instruct", dtype=args.dtype)
    ids_list = prompts(plain, args.prompts)
    bench_generate(packed, plain, ids_list[:1], 8)  # warm-up
    gen = bench_generate(packed, plain, ids_list, args.new)
    ver = bench_verify({"packed": packed, "plain": plain}, ids_list[0], args.reps)
    layouts = bench_layouts(plain, args.reps)
    med = lambda rows, k: statistics.median(r[k] for r in rows)
    summary = {
        "ours_tok_s_median": med(gen, "ours_tok_s"),
        "ours_plain_tok_s_median": med(gen, "ours_plain_tok_s"),
        "hf_tok_s_median": med(gen, "hf_tok_s"),
        "speed_ratio_ours_over_hf_median": med(gen, "ratio"),
        "speed_ratio_plain_over_hf_median": med(gen, "ratio_plain"),
        "identical_plain_vs_hf": all(r["same_tokens_plain_hf"] for r in gen),
        "identical_packed_vs_hf": sum(r["same_tokens_packed_hf"] for r in gen),
    }
    for layout in ("packed", "plain"):
        for key in ("step_ms", "verify16_ms", "verify60_ms", "verify16_over_step", "verify60_over_step"):
            summary[f"{layout}_{key}_median"] = med(ver, f"{layout}_{key}")
    result = {
        "hardware": {
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpus": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "target": f"smollm2-135m-instruct {args.dtype}",
        "new_tokens": args.new,
        "generate": gen,
        "verify": ver,
        "layouts_ms": layouts,
        "summary": summary,
    }
    (OUT / f"{stem}.json").write_text(json.dumps(result, indent=2))
    s = summary
    (OUT / f"{stem}.md").write_text(
        "| metric | packed (ours, default) | plain weights |\n|---|---|---|\n"
        f"| vanilla_generate tokens/s (median) | {s['ours_tok_s_median']:.1f} | {s['ours_plain_tok_s_median']:.1f} |\n"
        f"| HF generate greedy tokens/s (median, stock model) | {s['hf_tok_s_median']:.1f} | |\n"
        f"| ours / HF speed (median of per-prompt ratios) | {s['speed_ratio_ours_over_hf_median']:.2f}x | "
        f"{s['speed_ratio_plain_over_hf_median']:.2f}x |\n"
        f"| greedy outputs identical to HF (of {len(gen)} prompts) | {s['identical_packed_vs_hf']} | "
        f"{len(gen) if s['identical_plain_vs_hf'] else 'not all'} |\n"
        f"| single-token decode step (ms, median) | {s['packed_step_ms_median']:.1f} | {s['plain_step_ms_median']:.1f} |\n"
        f"| verify 16-token tree (ms, median) | {s['packed_verify16_ms_median']:.1f} | {s['plain_verify16_ms_median']:.1f} |\n"
        f"| verify 60-token tree (ms, median) | {s['packed_verify60_ms_median']:.1f} | {s['plain_verify60_ms_median']:.1f} |\n"
        f"| verify16 / step (median of ratios) | {s['packed_verify16_over_step_median']:.2f}x | "
        f"{s['plain_verify16_over_step_median']:.2f}x |\n"
        f"| verify60 / step (median of ratios) | {s['packed_verify60_over_step_median']:.2f}x | "
        f"{s['plain_verify60_over_step_median']:.2f}x |\n\n"
        "oneDNN layout by the batch it is packed for (median ms of one product with M input rows):\n\n"
        "| product, M | plain weights | packed for batch 1 | packed for batch 16 |\n|---|---|---|---|\n"
        + "".join(
            f"| {k} | {v['plain']:.3f} | {v['packed_b1']:.3f} | {v['packed_b16']:.3f} |\n" for k, v in layouts.items()
        )
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    axes[0].bar(
        ["ours (packed)", "ours (plain)", "HF generate"],
        [s["ours_tok_s_median"], s["ours_plain_tok_s_median"], s["hf_tok_s_median"]],
    )
    axes[0].set_ylabel("tokens/s (median)")
    labels = ["step", "16-tree", "60-tree"]
    for offset, layout in ((-0.2, "packed"), (0.2, "plain")):
        values = [s[f"{layout}_step_ms_median"], s[f"{layout}_verify16_ms_median"], s[f"{layout}_verify60_ms_median"]]
        axes[1].bar([i + offset for i in range(3)], values, 0.4, label=layout)
    axes[1].set_xticks(range(3), labels)
    axes[1].set_ylabel("ms per target pass (median)")
    axes[1].legend()
    fig.suptitle(f"SmolLM2-135M {args.dtype}, CPU")
    fig.tight_layout()
    fig.savefig(OUT / f"{stem}.png", dpi=100)
    print(json.dumps(s, indent=2))


if __name__ == "__main__":
    main()
