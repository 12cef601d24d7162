"""How long a training split takes to deliver each epoch of a small store, read three ways: through
``ray.data.read_parquet`` (before), through ``parts_dataset`` (a read task per part, now), and
materialized once (``train.materialize``). Checks that every way hands each rank the same rows.

A local Ray (the config's CPUs), the tiny target's store of ``data.limit`` ShareGPT conversations
(featurized under ``--out`` if it is not there yet), the train split cut as training cuts it
(``pipeline.train.feed``), two ranks reading side by side as Ray Train's ``streaming_split(2,
equal=True)`` hands them out, three epochs; two rounds, the ways alternating. Writes
benchmarks/training/epoch_start.{json,md}.

    python benchmarks/training/epoch_start.py [--out /tmp/epoch-start] [--limit 96]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[2]


def read_parquet_datasets(files: list[str], eval_ids: set[str]) -> dict:
    """The train and held-out datasets as they were built before ``parts_dataset``."""
    import ray

    from pipeline.train.feed import _filtered, feature_columns

    base = ray.data.read_parquet(files, columns=feature_columns("bf16", False), override_num_blocks=len(files))
    return {
        "train": _filtered(base, sorted(eval_ids), keep=False),
        "eval": _filtered(base, sorted(eval_ids), keep=True),
    }


def epochs(dataset, count: int = 3) -> tuple[list[float], list[list[list[str]]]]:
    """Seconds per epoch (rank 0) and the sample ids each of two ranks read in each epoch."""
    dataset.context.execution_options.preserve_order = True
    splits, seen, seconds = dataset.streaming_split(2, equal=True), [[], []], []

    def read(rank: int) -> None:
        for _ in range(count):
            start = time.perf_counter()
            tables = splits[rank].iter_batches(batch_size=None, batch_format="pyarrow")
            seen[rank].append([sid for table in tables for sid in table.column("sample_id").to_pylist()])
            if rank == 0:
                seconds.append(round(time.perf_counter() - start, 2))

    threads = [threading.Thread(target=read, args=(rank,)) for rank in (0, 1)]
    [thread.start() for thread in threads]
    [thread.join() for thread in threads]
    return seconds, seen


def measure(part_ids: dict[str, list[str]], eval_ids: set[str]) -> dict:
    from pipeline.train.feed import materialize, stored_datasets

    runs: dict[str, list[dict]] = {"read_parquet": [], "parts_dataset": [], "materialized": []}
    reference = None
    for _ in range(2):
        for way in runs:
            start = time.perf_counter()
            if way == "read_parquet":
                datasets = read_parquet_datasets(list(part_ids), eval_ids)
            else:
                datasets = stored_datasets(part_ids, "bf16", False, eval_ids)
                datasets = materialize(datasets) if way == "materialized" else datasets
            built = round(time.perf_counter() - start, 2)
            seconds, seen = epochs(datasets["train"])
            reference = reference or seen
            runs[way].append({"built_s": built, "epoch_s": seconds, "same_rows": seen == reference})
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/epoch-start")
    parser.add_argument("--limit", type=int, default=96)
    args = parser.parse_args()
    from pipeline.config import load_config
    from pipeline.data.featurize import run_featurize
    from pipeline.data.heldout import held_out_ids, store_part_ids
    from pipeline.data.store import read_manifest
    from pipeline.runtime import ensure_ray

    cfg = load_config(ROOT / "jobs/configs/tiny.yaml", [f"output_dir={args.out}", f"data.limit={args.limit}"])
    ensure_ray(cfg)
    if not Path(cfg.store_path, "_manifest.json").is_file() or not read_manifest(cfg.store_path)["complete"]:
        run_featurize(cfg)
    part_ids = store_part_ids(cfg.store_path)
    files = list(part_ids)
    eval_ids = held_out_ids([i for ids in part_ids.values() for i in ids], cfg.train.eval_fraction)
    runs = measure(part_ids, eval_ids)
    out = Path(__file__).parent
    (out / "epoch_start.json").write_text(json.dumps({"parts": len(files), "runs": runs}, indent=2))
    lines = [
        f"Tiny target, {len(files)} parts, the train split to two ranks, three epochs, two rounds "
        "(medians; seconds until an epoch's last row reached rank 0).",
        "",
        "| read through | datasets built, s | epoch 1, s | epochs 2-3, s | same rows per rank |",
        "|---|---|---|---|---|",
    ]
    for way, rows in runs.items():
        later = [s for row in rows for s in row["epoch_s"][1:]]
        lines.append(
            f"| {way} | {median(r['built_s'] for r in rows):.2f} | {median(r['epoch_s'][0] for r in rows):.2f} "
            f"| {median(later):.2f} | {all(r['same_rows'] for r in rows)} |"
        )
    (out / "epoch_start.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
