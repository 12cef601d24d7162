"""Deterministic data for Ray Train workers: held-out split, per-rank row streams, reduced vocab.

Exact resume needs every worker to see the same rows in the same order on every attempt, so the
order is fixed here rather than by a scheduler: each worker streams the store's part files (pyarrow,
any filesystem URI) in manifest order, shuffles within windows with a seeded RNG per epoch, and keeps
every ``world``-th train row starting at its rank (disjoint shards of equal size ±1). A data
position is the number of rows this rank has consumed since the start of the stage.

Why not ``ray.train.get_dataset_shard``: its streaming split hands blocks to whichever worker asks
first (no reproducible order, so no exact resume), and on this 2-core machine each epoch's Ray Data
pipeline start-up cost ~10 s. Reading the Parquet parts directly costs every worker a read of the
split's metadata and of the rows it drops, which at ShareGPT scale is small next to training.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import Counter
from collections.abc import Iterator

import pyarrow.parquet as pq
import torch

from griffin.config import LossWindow
from griffin.losses import ShiftedBatch, shift_batch
from pipeline.data.store import iter_rows, pad_batches, part_files

SHUFFLE_WINDOW = 256


def _hash(sample_id: str) -> int:
    return int(hashlib.sha256(str(sample_id).encode()).hexdigest()[:12], 16)


def eval_split(store: str, fraction: float) -> set[str]:
    """Held-out sample ids: the ``ceil(fraction * n)`` ids with the smallest hash (stable as the
    store grows, never empty when fraction > 0)."""
    ids = [sid for f in part_files(store) for sid in pq.read_table(f, columns=["sample_id"]).column(0).to_pylist()]
    if fraction <= 0 or not ids:
        return set()
    n_eval = min(len(ids) - 1, max(1, math.ceil(fraction * len(ids))))
    return set(sorted(ids, key=_hash)[:n_eval])


def token_frequencies(store: str, exclude: set[str], reply_only: bool = False) -> Counter:
    """Token counts over the training split; ``reply_only``: only the reply tokens (loss mask 1),
    the tokens a draft ever proposes, as EAGLE-3 and SpecForge count them."""
    counts: Counter = Counter()
    for f in part_files(store):
        table = pq.read_table(f, columns=["sample_id", "input_ids", "loss_mask"])
        for sid, ids, mask in zip(*(table.column(i).to_pylist() for i in range(3))):
            if sid not in exclude:
                counts.update(ids if not reply_only else [t for t, m in zip(ids, mask) if m])
    return counts


def reduced_vocabulary(
    store: str, size: int, vocab_size: int, exclude: set[str], reply_only: bool = False
) -> torch.Tensor:
    """The ``size`` most frequent target ids of the training split (all tokens, or only reply
    tokens), ties by id, sorted by id; rarely-seen ids fill up the rest when the data has fewer
    distinct tokens (EAGLE-3's d2t)."""
    if size > vocab_size:
        raise ValueError(f"draft.draft_vocab_size={size} exceeds the target vocabulary ({vocab_size})")
    counts = token_frequencies(store, exclude, reply_only)
    ranked = sorted(range(vocab_size), key=lambda i: (-counts.get(i, 0), i))
    return torch.tensor(sorted(ranked[:size]), dtype=torch.long)


def split_rows(files: list[str], ids: set[str], keep: bool, layers: bool = False) -> Iterator[dict]:
    """Rows whose sample id is in ``ids`` (keep=True) or not (keep=False); ``layers``: with the
    feature-layer columns."""
    return (row for row in iter_rows(files, layers) if (row["sample_id"] in ids) == keep)


def rank_rows(
    files: list[str], exclude: set[str], rank: int, world: int, seed: int, skip: int, layers: bool = False
) -> Iterator[dict]:
    """This rank's endless stream of train rows (epoch after epoch), after skipping ``skip`` rows."""
    epoch, seen = 0, 0
    while True:
        window: list[dict] = []
        rng = random.Random(f"{seed}-{epoch}")
        index = 0
        emitted = False
        for row in _windowed_shuffle(split_rows(files, exclude, keep=False, layers=layers), rng, window):
            if index % world == rank:
                emitted = True
                if seen >= skip:
                    yield {**row, "epoch": epoch}
                seen += 1
            index += 1
        if not emitted:
            raise ValueError(f"rank {rank} of {world} got no training rows: the store's train split is too small")
        epoch += 1


def _windowed_shuffle(rows, rng: random.Random, window: list[dict]) -> Iterator[dict]:
    for row in rows:
        window.append(row)
        if len(window) == SHUFFLE_WINDOW:
            rng.shuffle(window)
            yield from window
            window.clear()
    rng.shuffle(window)
    yield from window
    window.clear()


def shifted_batches(
    rows: Iterator[dict],
    batch_tokens: int,
    hidden_size: int,
    device,
    window: LossWindow = "draft",
    layers: bool = False,
) -> Iterator[tuple[ShiftedBatch, list[str]]]:
    """Padded, shifted training batches and the "<epoch>:<sample id>" of each row in them; with
    ``layers`` the batches' inputs are the rows' feature layers (a multi-layer draft's)."""
    epochs: dict[str, int] = {}

    def remember(stream):
        for row in stream:
            epochs[row["sample_id"]] = row.get("epoch", 0)
            yield row

    for batch in pad_batches(remember(rows), batch_tokens, hidden_size, layers):
        shifted = shift_batch(
            batch["features"].to(device),
            batch["input_ids"].to(device),
            batch["loss_mask"].to(device),
            batch["attention_mask"].to(device),
            window,
            batch["layer_features"].to(device) if layers else None,
        )
        yield shifted, [f"{epochs[sid]}:{sid}" for sid in batch["sample_ids"]]
