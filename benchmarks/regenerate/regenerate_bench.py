"""Benchmark: ``griffin regenerate``'s generation against a bare batched HF ``generate`` on the same
prompts, at several batch sizes (goal: >= 0.85x the bare call's generated tokens/s).

Both sides answer the first user turn of the same ShareGPT conversations greedily with the same
``max_new_tokens``. "bare" is what a user would write: the chat template through the tokenizer,
left padding, one ``model.generate`` per batch. "ours" is ``pipeline.data.regenerate.Regenerator.answer``
(special-token-safe rendering, per-row stop handling, decoding to text). The two alternate per batch
size and repeat; we report medians of tokens/s and of the per-repeat ratio.

    .venv/bin/python benchmarks/regenerate/regenerate_bench.py [--conversations 16] [--max-new-tokens 64] [--repeats 3]
Writes benchmarks/regenerate/regenerate.json and benchmarks/regenerate/regenerate.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipeline.config import load_config  # noqa: E402
from pipeline.data.chat import render_text  # noqa: E402
from pipeline.data.regenerate import Regenerator  # noqa: E402
from pipeline.data.sources import Ledger, load_conversations  # noqa: E402

OUT = Path(__file__).parent
CONFIG = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "smollm2-quick.yaml"


def bare_generate(regenerator: Regenerator, questions: list[str], batch_size: int, max_new: int) -> int:
    """Generated tokens (through the first stop token) of HF generate over ``questions``."""
    model, tokenizer = regenerator.target.model, regenerator.target.tokenizer
    tokenizer.padding_side = "left"
    tokens = 0
    for start in range(0, len(questions), batch_size):
        texts = [
            render_text(tokenizer, [{"role": "user", "content": q}], generation_prompt=True)
            for q in questions[start : start + batch_size]
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(
                **batch,
                max_new_tokens=max_new,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                eos_token_id=regenerator.stop_ids,
                pad_token_id=regenerator.pad_id,
            )[:, batch["input_ids"].shape[1] :]
        for row in out.tolist():
            stops = [i for i, t in enumerate(row) if t in regenerator.stop_ids]
            tokens += stops[0] + 1 if stops else len(row)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1,4,8,16")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = load_config(CONFIG, [f"data.limit={args.conversations}"])
    conversations = load_conversations(cfg.data, Ledger())
    questions = [
        c.messages[0]["content"] if c.messages[0]["role"] == "user" else c.messages[1]["content"] for c in conversations
    ]
    regenerator = Regenerator(
        cfg.target.model_dump(),
        {"temperature": 0.0, "top_p": 1.0, "batch_size": 1, "max_new_tokens": args.max_new_tokens, "max_len": 100_000},
    )
    single_turns = [[{"role": "user", "content": q}] for q in questions]
    bare_generate(regenerator, questions[:2], 2, 8)  # warm-up
    rows = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        samples = {"bare": [], "ours": []}
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = bare_generate(regenerator, questions, batch_size, args.max_new_tokens)
            samples["bare"].append(tokens / (time.perf_counter() - start))
            regenerator.settings["batch_size"] = batch_size
            start = time.perf_counter()
            _, generated, _ = regenerator.answer(single_turns)
            samples["ours"].append(sum(generated) / (time.perf_counter() - start))
        ratios = [o / b for o, b in zip(samples["ours"], samples["bare"])]
        rows.append(
            {
                "batch_size": batch_size,
                "bare_tokens_per_s": statistics.median(samples["bare"]),
                "ours_tokens_per_s": statistics.median(samples["ours"]),
                "ratio": statistics.median(ratios),
                "samples": samples,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "target": cfg.target.name,
        "dtype": str(regenerator.target.dtype),
        "threads": torch.get_num_threads(),
        "conversations": len(questions),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "machine": platform.processor() or platform.machine(),
        "rows": rows,
    }
    (OUT / "regenerate.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"# `griffin regenerate` generation vs bare batched HF generate ({cfg.target.name}, "
        f"{result['dtype']}, {result['threads']} threads)",
        "",
        f"{len(questions)} ShareGPT first turns, greedy, {args.max_new_tokens} new tokens at most, "
        f"{args.repeats} interleaved repeats, medians.",
        "",
        "| batch size | bare HF generate, tokens/s | ours, tokens/s | ours / bare |",
        "|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['batch_size']} | {r['bare_tokens_per_s']:.0f} | {r['ours_tokens_per_s']:.0f} | {r['ratio']:.2f}x |"
        for r in rows
    ]
    (OUT / "regenerate.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
