"""How full the training micro-batches are when every rank packs its own rows, against the lockstep
rule training used before (every rank took the smallest of the ranks' fitting row counts, one
integer all-reduce a micro-batch).

Real row lengths: ShareGPT conversations rendered and tokenized as featurize does (the SmolLM2
tokenizer, at each setting's ``data.max_len``), in a shuffled order, dealt to W ranks in ``ROWS_PER_BLOCK``-row blocks
round robin, as the training stream deals them. Each rule packs with ``pipeline.train.batches.fitting``
(B * T_max <= ``train.batch_tokens``) until a rank's share is used up. Reported per rule and world size:
- fill: real tokens / the micro-batches' padded size (B * T_max), over all micro-batches;
- budget use: real tokens / (micro-batches * batch_tokens);
- micro-batches per rank to read one epoch (fewer: the same data in fewer steps);
- own packing only: the widest gap between two ranks' rows taken, left uncontrolled (what
  ``batches.DRIFT_ROWS`` bounds in training; the bound is tested in tests/pipeline/test_train.py).
Writes benchmarks/training/packing.{json,md}.

    python benchmarks/training/packing.py [--conversations 6000] [--settings 2048:8192,1024:8192]

The default settings are llama3-8b-gpu.yaml's and smollm2-gpu.yaml's (data.max_len:train.batch_tokens).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "scale_out"))

from restart_cost import cpu_name  # noqa: E402

WORLDS = (2, 8, 32)


def row_lengths(conversations: int, max_len: int) -> list[int]:
    """Token counts of ShareGPT conversations as featurize builds them (skipped ones left out)."""
    from pipeline.config import load_config
    from pipeline.data.sources import Ledger, SkipSample, build_sample, load_conversations
    from pipeline.resources.identity import target_identity

    cfg = load_config(
        ROOT / "jobs/configs/smollm2-quick.yaml", [f"data.limit={conversations}", f"data.max_len={max_len}"]
    )
    target = target_identity(cfg.target)
    lengths = []
    for conversation in load_conversations(cfg.training_data, Ledger()):
        try:
            sample = build_sample(conversation, target.tokenizer, max_len, set(target.stop_token_ids))
        except SkipSample:
            continue
        lengths.append(len(sample.input_ids))
    return lengths


def dealt(lengths: list[int], world: int, block: int) -> list[list[int]]:
    """Each rank's rows: ``block``-row blocks of the stream dealt round robin."""
    blocks = [lengths[i : i + block] for i in range(0, len(lengths), block)]
    return [[n for b in blocks[rank::world] for n in b] for rank in range(world)]


def pack(shares: list[list[int]], budget: int, lockstep: bool) -> dict:
    """Micro-batches (row lengths) of every rank until one rank's share is used up."""
    from pipeline.train.batches import fitting

    at, batches, gap = [0] * len(shares), [[] for _ in shares], 0
    while True:
        fits = [fitting(share[i:], budget) for share, i in zip(shares, at)]
        if min(fits) == 0:
            break
        for rank, fit in enumerate([min(fits)] * len(shares) if lockstep else fits):
            batches[rank].append(shares[rank][at[rank] : at[rank] + fit])
            at[rank] += fit
        gap = max(gap, max(at) - min(at))
    rows = [b for rank in batches for b in rank]
    tokens = sum(sum(b) for b in rows)
    return {
        "fill": round(tokens / sum(len(b) * max(b) for b in rows), 4),
        "budget_use": round(tokens / (len(rows) * budget), 4),
        "micro_batches_per_rank": len(batches[0]),
        "rows_per_rank": round(sum(at) / len(at), 1),
        "micro_batches_per_epoch": round(len(batches[0]) * sum(map(len, shares)) / max(sum(at), 1), 1),
        "widest_gap_rows": gap,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=6000)
    parser.add_argument("--settings", default="2048:8192,1024:8192", help="max_len:batch_tokens, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from pipeline.train.inputs import ROWS_PER_BLOCK

    settings = []
    for setting in args.settings.split(","):
        max_len, budget = map(int, setting.split(":"))
        lengths = row_lengths(args.conversations, max_len)
        random.Random(args.seed).shuffle(lengths)
        results = {}
        for world in WORLDS:
            shares = dealt(lengths, world, ROWS_PER_BLOCK)
            results[world] = {rule: pack(shares, budget, rule == "lockstep") for rule in ("lockstep", "own")}
        mean = round(sum(lengths) / len(lengths), 1)
        settings.append(
            {"max_len": max_len, "batch_tokens": budget, "rows": len(lengths), "mean_length": mean, "results": results}
        )
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{cpu_name()}, {os.cpu_count()} threads",
        "args": vars(args),
        "settings": settings,
    }
    out = Path(__file__).resolve().parent
    (out / "packing.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "packing.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = [
        "# Micro-batch packing: each rank its own rows vs lockstep (the smallest count on every rank)",
        "",
        f"{report['date']}, {report['machine']}. ShareGPT rows (SmolLM2 tokenizer), shuffled, dealt in 16-row "
        "blocks round robin; micro-batches of at most `train.batch_tokens` padded (B * T_max). "
        "`python benchmarks/training/packing.py`.",
        "",
        "| max_len / batch_tokens | ranks | rule | fill (tokens / B*T_max) | budget use | micro-batches per rank per epoch | widest gap (rows) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in report["settings"]:
        label = f"{s['max_len']} / {s['batch_tokens']} ({s['rows']} rows, mean {s['mean_length']})"
        for world, rules in s["results"].items():
            for rule, r in rules.items():
                gap = r["widest_gap_rows"] if rule == "own" else "0 (lockstep)"
                lines.append(
                    f"| {label} | {world} | {rule} | {r['fill']:.3f} | {r['budget_use']:.3f} | "
                    f"{r['micro_batches_per_epoch']} | {gap} |"
                )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
