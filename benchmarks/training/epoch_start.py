"""How long a training stream takes to start each epoch on a small store: one Ray Data execution per
epoch (how training read before), against one execution that spans the epochs (``pipeline.train.stream``),
each from the part files and from parts held in the object store (``train.materialize``).

A local Ray (the config's CPUs), the tiny target's store of ``data.limit`` ShareGPT conversations
(featurized under ``--out`` if it is not there yet), the training parts as training cuts them, two
ranks reading side by side as Ray Train splits the stream (``pipeline.train.inputs.data_config``), three
epochs; two rounds, the ways alternating. An epoch's start is the wait at rank 0 between the previous
epoch's last block and the new epoch's first. Checks that files and held parts deal each rank the same rows (one execution per epoch deals
another round robin: each starts again at rank 0).
Writes benchmarks/training/epoch_start.{json,md}.

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
EPOCHS = 3


def read(parts, starts: list[dict]) -> tuple[list[tuple[float, int]], list[list[str]]]:
    """One execution of the stream per start, of one dataset and one split (as Ray Train holds them),
    read by two ranks: rank 0's (arrival time, epoch) per block, and the "<epoch>:<sample id>"s each
    rank read."""
    import ray

    from pipeline.train.inputs import data_config
    from pipeline.train.stream import StreamStart, train_stream

    actor = ray.remote(num_cpus=0)(StreamStart).remote()
    ray.get(actor.set_stream_start.remote(starts[0]))
    splits = data_config().configure({"train": train_stream(parts, actor)}, 2, None, None)
    arrivals: list[tuple[float, int]] = []
    seen: list[list[str]] = [[], []]
    barrier = threading.Barrier(2)

    def consume(rank: int) -> None:
        for start in starts:
            if rank == 0:  # as rank 0 does before an execution: say where it starts
                ray.get(actor.set_stream_start.remote(start))
            barrier.wait()
            for table in splits[rank]["train"].iter_batches(batch_size=None, batch_format="pyarrow"):
                epochs = table["epoch"].to_pylist()
                if rank == 0:
                    arrivals.append((time.perf_counter(), epochs[0]))
                seen[rank] += [f"{e}:{s}" for e, s in zip(epochs, table["sample_id"].to_pylist())]

    threads = [threading.Thread(target=consume, args=(rank,)) for rank in (0, 1)]
    [thread.start() for thread in threads]
    [thread.join() for thread in threads]
    ray.kill(actor)
    return arrivals, seen


def epoch_starts(parts, spanning: bool) -> tuple[list[float], list[list[str]]]:
    """Seconds rank 0 waited for each epoch's first block after the previous epoch's last, and the rows
    each rank read, with one execution for all epochs or one per epoch (the same dataset and split
    run again, as Ray Train's split did every epoch)."""
    from pipeline.train.stream import first_start

    began = time.perf_counter()
    starts = [first_start(0, EPOCHS)] if spanning else [first_start(epoch, 1) for epoch in range(EPOCHS)]
    arrivals, seen = read(parts, starts)
    waits, last = [], began
    for moment, epoch in arrivals:
        if epoch == len(waits):
            waits.append(round(moment - last, 3))
        last = moment
    return waits, seen


def measure(part_ids: dict[str, list[str]], eval_ids: set[str]) -> dict:
    from pipeline.train.inputs import materialized_parts, stored_parts

    files = stored_parts(part_ids, "bf16", False, eval_ids, 0)
    start = time.perf_counter()
    held = materialized_parts(files)
    held_s = round(time.perf_counter() - start, 2)
    ways = {
        "execution per epoch, files": (files, False),
        "execution per epoch, held": (held, False),
        "one execution, files": (files, True),
        "one execution, held": (held, True),
    }
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    reference: dict[bool, list] = {}  # the rows per rank of the first run with one or many executions
    for _ in range(2):
        for way, (parts, spanning) in ways.items():
            waits, seen = epoch_starts(parts, spanning)
            reference.setdefault(spanning, seen)
            runs[way].append({"epoch_start_s": waits, "same_rows": seen == reference[spanning]})
    return {"materialize_s": held_s, "runs": runs}


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
    result = measure(part_ids, eval_ids)
    out = Path(__file__).parent
    (out / "epoch_start.json").write_text(json.dumps({"parts": len(files), **result}, indent=2))
    lines = [
        f"Tiny target, {len(files)} parts, the training parts to two ranks, {EPOCHS} epochs, two rounds "
        "(medians; seconds rank 0 waited for an epoch's first block after the previous epoch's last). "
        f"Holding the parts in the object store took {result['materialize_s']} s.",
        "",
        "| read through | epoch 1 start, s | epochs 2-3 start, s | same rows per rank |",
        "|---|---|---|---|",
    ]
    for way, rows in result["runs"].items():
        later = [s for row in rows for s in row["epoch_start_s"][1:]]
        lines.append(
            f"| {way} | {median(r['epoch_start_s'][0] for r in rows):.2f} | {median(later):.2f} "
            f"| {all(r['same_rows'] for r in rows)} |"
        )
    (out / "epoch_start.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
