"""The data a training stage reads: held-out split, reduced vocabulary, and each worker's feed.

Each Ray Train worker reads its shard of the stage's Ray Data datasets (``pipeline.train.feed``:
``streaming_split(world, equal=True)``, so a rank reads ~1/world of the rows). ``ShardFeed`` turns a
shard into micro-batches:

- **Lockstep.** Every rank takes the same number of rows per micro-batch: each proposes how many of
  its next rows fit ``batch_tokens`` (B * T_max), and all take the smallest proposal (one integer
  all-reduce). Ranks hold equal row counts per epoch (the equal split), so they reach the end of an
  epoch at the same micro-batch and start the next one together: Ray Data starts an epoch only when
  every split asks for it, and a rank that ran ahead would wait there while the others wait for its
  gradients.
- **Deterministic.** The datasets run with ``preserve_order``: the same blocks reach the same rank in
  the same order on every attempt, and each rank shuffles its rows within windows with a seed of
  (seed, epoch, rank). A data position is (epoch, rows taken in it), the same on every rank, so a
  resumed stage skips exactly the rows it had trained on.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow.parquet as pq
import torch

from griffin.config import LossWindow
from griffin.losses import ShiftedBatch, shift_batch
from pipeline.config import TrainSection
from pipeline.data.store import iter_rows, pad_batches, part_files, table_rows

SHUFFLE_WINDOW = 256


def store_tokens(store: str) -> Iterator[tuple[str, list[int], list[int]]]:
    """(sample id, input ids, loss mask) of every stored row, without the features."""
    for f in part_files(store):
        table = pq.read_table(f, columns=["sample_id", "input_ids", "loss_mask"])
        yield from zip(*(table.column(i).to_pylist() for i in range(3)))


def token_frequencies(records: Iterable[tuple[str, Any, Any]], exclude: set[str], reply_only: bool = False) -> Counter:
    """Token counts over (sample id, ids, mask) records not in ``exclude``; ``reply_only``: only the
    reply tokens (loss mask 1), the tokens a draft ever proposes, as EAGLE-3 and SpecForge count them."""
    counts: Counter = Counter()
    for sid, ids, mask in records:
        if sid not in exclude:
            counts.update(ids if not reply_only else [t for t, m in zip(ids, mask) if m])
    return counts


def reduced_vocabulary(
    records: Iterable[tuple[str, Any, Any]], size: int, vocab_size: int, exclude: set[str], reply_only: bool = False
) -> torch.Tensor:
    """The ``size`` most frequent target ids of the training records (all tokens, or only reply
    tokens), ties by id, sorted by id; rarely-seen ids fill up the rest when the data has fewer
    distinct tokens (EAGLE-3's d2t)."""
    if size > vocab_size:
        raise ValueError(f"draft.draft_vocab_size={size} exceeds the target vocabulary ({vocab_size})")
    counts = token_frequencies(records, exclude, reply_only)
    ranked = sorted(range(vocab_size), key=lambda i: (-counts.get(int(i), 0), i))
    return torch.tensor(sorted(ranked[:size]), dtype=torch.long)


def split_rows(files: list[str], ids: set[str], keep: bool, layers: bool = False) -> Iterator[dict]:
    """Stored rows whose sample id is in ``ids`` (keep=True) or not (keep=False), read on this process
    (benchmarks; training reads through Ray Data); ``layers``: with the feature-layer columns."""
    return (row for row in iter_rows(files, layers) if (row["sample_id"] in ids) == keep)


def row_bytes(row: dict) -> int:
    """The feature bytes a row holds (and pins of its block while it waits in a shuffle window)."""
    return sum(row[k].size for k in ("hidden", "layers") if row.get(k) is not None)


def windowed_shuffle(rows: Iterable[dict], rng: random.Random, max_bytes: int) -> Iterator[dict]:
    """``rows`` shuffled within consecutive windows of ``SHUFFLE_WINDOW`` rows or ``max_bytes`` of
    features, whichever is reached first (``train.shuffle_bytes``: an 8B target's 2k-token row is 16 MB,
    a 3-layer draft's 64 MB): the store's parts are length-sorted runs, so a window mixes rows of
    similar length (little padding)."""
    window: list[dict] = []
    held = 0
    for row in rows:
        window.append(row)
        held += row_bytes(row)
        if len(window) == SHUFFLE_WINDOW or held >= max_bytes:
            rng.shuffle(window)
            yield from window
            window.clear()
            held = 0
    rng.shuffle(window)
    yield from window


def shard_rows(shard, block_bytes: list[int]) -> Iterator[dict]:
    """One epoch of a Ray Data shard as rows (views on its Arrow blocks); appends each block's bytes to
    ``block_bytes`` as it arrives (what this rank read)."""
    for table in shard.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1):
        block_bytes.append(table.nbytes)
        yield from table_rows(table)


class ShardFeed:
    """This rank's training rows, epoch after epoch, as lists of rows that fit ``batch_tokens``, the
    same number of rows on every rank (module docstring), shuffled in windows of at most
    ``train.shuffle_bytes``. ``epoch``, ``taken``: where to resume."""

    def __init__(self, shard, rank: int, world: int, device, train: TrainSection, epoch: int = 0, taken: int = 0):
        self.shard, self.rank, self.world, self.device = shard, rank, world, device
        self.seed, self.batch_tokens, self.shuffle_bytes = train.seed, train.batch_tokens, train.shuffle_bytes
        self.epoch, self.taken = epoch, taken
        self.block_bytes: list[int] = []  # bytes of every block this rank received, this attempt
        self.finished: list[dict[str, int]] = []  # epochs read to the end: their rows and bytes on this rank
        self._start_epoch(skip=taken)

    def _start_epoch(self, skip: int) -> None:
        rng = random.Random(f"{self.seed}-{self.epoch}-{self.rank}")
        self._epoch_start = len(self.block_bytes)
        self._rows = windowed_shuffle(shard_rows(self.shard, self.block_bytes), rng, self.shuffle_bytes)
        self._ahead: list[dict] = []
        for _ in range(skip):  # rows the interrupted attempt trained on in this epoch
            if next(self._rows, None) is None:
                raise ValueError(f"resume position {skip} is past the end of epoch {self.epoch}'s rows")

    def _fitting(self) -> int:
        """How many of the next rows fit the budget (a row longer than the budget goes alone); 0 when
        this epoch's rows are used up."""
        n, longest = 0, 0
        while True:
            if n == len(self._ahead):
                row = next(self._rows, None)
                if row is None:
                    return n
                self._ahead.append(row)
            length = int(self._ahead[n]["seq_len"])
            if n and (n + 1) * max(longest, length) > self.batch_tokens:
                return n
            longest, n = max(longest, length), n + 1

    def _agree(self, count: int) -> int:
        if self.world == 1:
            return count
        agreed = torch.tensor([count], device=self.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        return int(agreed.item())

    def take(self) -> tuple[list[dict], int]:
        """The next micro-batch's rows and the epoch they belong to."""
        count = self._agree(self._fitting())
        if count == 0:  # every rank's share of this epoch is used up, at the same micro-batch
            if self.taken == 0:
                raise ValueError(
                    f"rank {self.rank} of {self.world} got no training rows: the store's train split is too "
                    "small for this many workers"
                )
            read = sum(self.block_bytes[self._epoch_start :])  # the whole share, skipped rows included
            self.finished.append({"epoch": self.epoch, "rows": self.taken, "bytes": read})
            self.epoch, self.taken = self.epoch + 1, 0
            self._start_epoch(skip=0)
            return self.take()
        rows, self._ahead = self._ahead[:count], self._ahead[count:]
        self.taken += count
        return rows, self.epoch


def shifted_batches(
    rows: Iterable[dict],
    batch_tokens: int,
    hidden_size: int,
    device,
    window: LossWindow = "draft",
    layers: bool = False,
    epoch: int = 0,
) -> Iterator[tuple[ShiftedBatch, list[str]]]:
    """Padded, shifted training batches and the "<epoch>:<sample id>" of each row in them; with
    ``layers`` the batches' inputs are the rows' feature layers (a multi-layer draft's)."""
    for batch in pad_batches(rows, batch_tokens, hidden_size, layers):
        shifted = shift_batch(
            batch["features"].to(device),
            batch["input_ids"].to(device),
            batch["loss_mask"].to(device),
            batch["attention_mask"].to(device),
            window,
            batch["layer_features"].to(device) if layers else None,
        )
        yield shifted, [f"{epoch}:{sid}" for sid in batch["sample_ids"]]


def feed_batch(feed: ShardFeed, hidden_size: int, window: LossWindow, layers: bool) -> tuple[ShiftedBatch, list[str]]:
    """The next micro-batch of ``feed``, padded and shifted, and its "<epoch>:<sample id>"s."""
    rows, epoch = feed.take()
    longest = max(int(r["seq_len"]) for r in rows)
    (batch,) = shifted_batches(rows, len(rows) * longest, hidden_size, feed.device, window, layers, epoch)
    return batch
