"""Issue 2 benchmark: our vanilla decoding vs HF generate, and tree-verify cost vs one decode step.

Real target (SmolLM2-135M-Instruct, bf16, CPU). A/B runs are interleaved per prompt in one
process; we report medians of per-prompt ratios. Writes benchmarks/decode.json, decode.md, decode.png.

    python benchmarks/decode_bench.py [--prompts 8] [--new 64] [--reps 15]
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
from griffin.model import GriffinDraft, KVCache
from griffin.target import TargetAdapter
from griffin.tree import draft_tree

OUT = Path(__file__).parent
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench.jsonl"


def prompts(target, n):
    lines = [json.loads(x) for x in DATA.read_text().splitlines()[:n]]
    return [target.tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}],
                                                 add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
            for q in lines]


def time_it(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench_generate(target, ids_list, new_tokens):
    rows = []
    for ids in ids_list:
        ours_s, ours = time_it(lambda: vanilla_generate(target, ids, SamplingConfig(), new_tokens, stop_token_ids=[]))
        hf_s, hf = time_it(lambda: target.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                        do_sample=False, pad_token_id=0))
        same = ours.tokens == hf[0, ids.shape[1]:].tolist()
        rows.append({"prompt_len": ids.shape[1], "ours_tok_s": new_tokens / ours_s, "hf_tok_s": new_tokens / hf_s,
                     "ratio": hf_s / ours_s, "same_tokens": same})
    return rows


def bench_verify(target, ids, reps):
    draft = GriffinDraft.for_target(target).cast_parameters(target.dtype).eval()
    cache = target.new_cache(ids.shape[1] + 128)
    features, _ = target.forward(ids, cache, all_logits=False)
    tokens = torch.cat([ids[0, 1:], torch.tensor([42])])[None]
    tree = draft_tree(draft, KVCache.allocate(draft.cfg, 512, dtype=target.dtype), features, tokens, TreeConfig())
    prefix = cache.length
    rows = []
    for _ in range(reps):
        verify_s, _ = time_it(lambda: target.verify(tree.tokens, tree.depths, tree.mask, cache))
        cache.keep(prefix, torch.arange(prefix, prefix))  # drop the tree again
        step_s, _ = time_it(lambda: target.forward(torch.tensor([[42]]), cache, all_logits=False))
        cache.keep(prefix, torch.arange(prefix, prefix))
        rows.append({"verify60_ms": verify_s * 1e3, "step_ms": step_s * 1e3, "ratio": verify_s / step_s})
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    target = TargetAdapter.from_pretrained("smollm2-135m-instruct", dtype="bfloat16")
    ids_list = prompts(target, args.prompts)
    bench_generate(target, ids_list[:1], 8)  # warm-up
    gen = bench_generate(target, ids_list, args.new)
    ver = bench_verify(target, ids_list[0], args.reps)
    med = lambda rows, k: statistics.median(r[k] for r in rows)
    result = {
        "hardware": {"machine": platform.machine(), "processor": platform.processor(), "cpus": torch.get_num_threads(),
                     "torch": torch.__version__},
        "target": "smollm2-135m-instruct bf16", "new_tokens": args.new,
        "generate": gen, "verify": ver,
        "summary": {"ours_tok_s_median": med(gen, "ours_tok_s"), "hf_tok_s_median": med(gen, "hf_tok_s"),
                    "speed_ratio_ours_over_hf_median": med(gen, "ratio"),
                    "all_outputs_identical": all(r["same_tokens"] for r in gen),
                    "verify60_ms_median": med(ver, "verify60_ms"), "step_ms_median": med(ver, "step_ms"),
                    "verify60_over_step_median": med(ver, "ratio")},
    }
    (OUT / "decode.json").write_text(json.dumps(result, indent=2))
    s = result["summary"]
    (OUT / "decode.md").write_text(
        "| metric | value |\n|---|---|\n"
        f"| vanilla_generate tokens/s (median) | {s['ours_tok_s_median']:.1f} |\n"
        f"| HF generate greedy tokens/s (median) | {s['hf_tok_s_median']:.1f} |\n"
        f"| ours / HF speed (median of per-prompt ratios) | {s['speed_ratio_ours_over_hf_median']:.2f}x |\n"
        f"| identical greedy outputs | {s['all_outputs_identical']} |\n"
        f"| verify 60-token tree (ms, median) | {s['verify60_ms_median']:.1f} |\n"
        f"| single-token decode step (ms, median) | {s['step_ms_median']:.1f} |\n"
        f"| verify60 / step (median of ratios) | {s['verify60_over_step_median']:.2f}x |\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(["ours (vanilla)", "HF generate"], [s["ours_tok_s_median"], s["hf_tok_s_median"]])
    axes[0].set_ylabel("tokens/s (median)")
    axes[1].bar(["1-token step", "60-token tree"], [s["step_ms_median"], s["verify60_ms_median"]])
    axes[1].set_ylabel("ms per target pass (median)")
    fig.suptitle("SmolLM2-135M bf16, CPU")
    fig.tight_layout()
    fig.savefig(OUT / "decode.png", dpi=100)
    print(json.dumps(s, indent=2))


if __name__ == "__main__":
    main()
