"""The data a training stage reads: held-out split, reduced vocabulary, and each worker's feed.

Each Ray Train worker reads its shard of the stage's stream (``pipeline.train.stream``: blocks dealt
round robin, so a rank reads ~1/world of the rows). ``ShardFeed`` turns a shard into micro-batches:

- **Lockstep.** Every rank takes the same number of rows per micro-batch: each proposes how many of
  its next rows fit ``batch_tokens`` (B * T_max), and all take the smallest proposal (one integer
  all-reduce). When one rank's share of an execution is used up, every rank starts the next
  execution together (the rest of a block per rank, at most, is left).
- **Deterministic.** The stream runs with ``preserve_order``: the same blocks reach the same rank in
  the same order on every attempt. A data position is the place of a block (epoch, part, row), the
  same on every rank, and how far into it the ranks are, so a resumed stage starts its stream there
  and skips exactly the rows it had trained on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from griffin.config import LossWindow
from griffin.losses import ShiftedBatch, shift_batch
from pipeline.config import TrainSection
from pipeline.data.store import iter_rows, pad_batches, part_files, table_rows
from pipeline.train.stream import POSITION, first_start


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


def shard_rows(shard, feed: "ShardFeed") -> Iterator[dict]:
    """One execution of a Ray Data shard of the stage's stream as rows (views on its Arrow blocks), each
    with its ``epoch``, the place of its block's first row (``block``) and its ``offset`` in the block;
    ``feed.received`` counts each block as it arrives."""
    for table in shard.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1):
        if not table.num_rows:
            continue
        epochs = table["epoch"].to_numpy()
        feed.received(epochs, table.nbytes)
        block = {key: int(table[key][0].as_py()) for key in POSITION}
        for offset, (row, epoch) in enumerate(zip(table_rows(table), epochs)):
            row.update(epoch=int(epoch), block=block, offset=offset)  # table_rows makes a new dict per row
            yield row


class ShardFeed:
    """This rank's training rows from the stage's stream (``pipeline.train.stream``), as lists of rows
    that fit ``batch_tokens``, the same number of rows on every rank (module docstring). ``start``:
    where the stream starts (``first_start``, or a checkpoint's ``position()``); ``stream_start``: the
    stage's ``StreamStart`` actor (its ``StageChannel``), which rank 0 tells before the ranks read."""

    def __init__(self, shard, rank: int, world: int, device, train: TrainSection, stream_start, start, epochs: int):
        self.shard, self.rank, self.world, self.device = shard, rank, world, device
        self.batch_tokens, self.stream_start, self.epochs = train.batch_tokens, stream_start, epochs
        self.block_bytes: list[int] = []  # bytes of every block this rank received, this attempt
        self.per_epoch: dict[int, dict[str, int]] = {}  # rows and bytes received of each epoch, this attempt
        self._open(start)

    def _open(self, start: dict[str, Any]) -> None:
        """Start an execution at ``start``: rank 0 says where, every rank waits for that, then skips the
        rows of its first block that it trained on before."""
        import ray

        if self.rank == 0:
            ray.get(self.stream_start.set_stream_start.remote(start))
        if self.world > 1:
            torch.distributed.barrier()
        self.start, self.taken, self._ahead = start, 0, []
        self._rows = shard_rows(self.shard, self)
        for _ in range(start["skip"]):
            if next(self._rows, None) is None:
                raise ValueError(f"resume position {start} is past the end of the stream")

    def received(self, epochs: np.ndarray, nbytes: int) -> None:
        self.block_bytes.append(nbytes)
        for epoch, rows in zip(*np.unique(epochs, return_counts=True)):
            seen = self.per_epoch.setdefault(int(epoch), {"epoch": int(epoch), "rows": 0, "bytes": 0})
            seen["rows"] += int(rows)
            seen["bytes"] += nbytes * int(rows) // len(epochs)

    @property
    def finished(self) -> list[dict[str, int]]:
        """The epochs this rank has read to the end (a row of a later one has arrived)."""
        last = max(self.per_epoch, default=0)
        return [seen for epoch, seen in sorted(self.per_epoch.items()) if epoch < last]

    def _fitting(self) -> int:
        """How many of the next rows fit the budget (a row longer than the budget goes alone); 0 when
        this execution's rows are used up."""
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

    def take(self) -> list[dict]:
        """The next micro-batch's rows."""
        count = self._agree(self._fitting())
        if count == 0:  # a rank's share of this execution is used up: every rank starts the next
            if self.taken == 0:
                raise ValueError(
                    f"rank {self.rank} of {self.world} got no training rows: the store's train split is too "
                    "small for this many workers"
                )
            self._open(first_start(self.start["end"], self.epochs))
            return self.take()
        rows, self._ahead = self._ahead[:count], self._ahead[count:]
        self.taken += count
        return rows

    def position(self, row: dict | None = None) -> dict[str, Any]:
        """Where a resumed stage starts (rank 0's, which holds for every rank): the block of ``row`` (by
        default the next row) and how far into it, in a stream with this one's end; or the next
        execution's start."""
        if row is None and not self._ahead and (peeked := next(self._rows, None)) is not None:
            self._ahead.append(peeked)
        row = row or (self._ahead[0] if self._ahead else None)
        if row is None:
            return first_start(self.start["end"], self.epochs)
        return {**row["block"], "skip": row["offset"], "end": self.start["end"]}


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """``tensor`` on ``device``; to a GPU from pinned memory without blocking the host (the copy is
    queued on the device's default stream, ahead of the step that reads it)."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def shifted_batches(
    rows: Iterable[dict],
    batch_tokens: int,
    hidden_size: int,
    device,
    window: LossWindow = "draft",
    layers: bool = False,
) -> Iterator[tuple[ShiftedBatch, list[str]]]:
    """Padded, shifted training batches and the sample id of each row in them; with ``layers`` the
    batches' inputs are the rows' feature layers (a multi-layer draft's)."""
    for batch in pad_batches(rows, batch_tokens, hidden_size, layers):
        shifted = shift_batch(
            to_device(batch["features"], device),
            to_device(batch["input_ids"], device),
            to_device(batch["loss_mask"], device),
            to_device(batch["attention_mask"], device),
            window,
            to_device(batch["layer_features"], device) if layers else None,
        )
        yield shifted, list(batch["sample_ids"])


def collate(rows: list[dict], hidden_size: int, device, window: LossWindow, layers: bool) -> ShiftedBatch:
    """One micro-batch's rows padded, shifted and on ``device``."""
    longest = max(int(r["seq_len"]) for r in rows)
    ((batch, _),) = shifted_batches(rows, len(rows) * longest, hidden_size, device, window, layers)
    return batch


class Prefetch:
    """``feed``'s micro-batches, each collated (decoded, padded, shifted, copied to the device) on a
    background thread while the one before it trains. Rows are taken on the training thread, one
    micro-batch ahead: taking is a collective (the lockstep all-reduce), and every rank must issue its
    collectives in the same order."""

    def __init__(self, feed: ShardFeed, hidden_size: int, window: LossWindow, layers: bool, count: int):
        from concurrent.futures import ThreadPoolExecutor

        self.feed, self.shape, self.left = feed, (hidden_size, window, layers), count  # micro-batches to come
        cuda = torch.device(feed.device).type == "cuda"  # the thread's pinned copies go to this rank's GPU
        setup = {"initializer": torch.cuda.set_device, "initargs": (feed.device,)} if cuda else {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="collate", **setup)
        self._pending = self._ahead()

    def _ahead(self):
        """The next micro-batch's rows and its collation under way; None past the stage's last."""
        if self.left == 0:
            return None
        self.left -= 1
        rows = self.feed.take()
        return rows, self.pool.submit(collate, rows, self.shape[0], self.feed.device, *self.shape[1:])

    def next(self) -> tuple[ShiftedBatch, list[str]]:
        """The next micro-batch and its "<epoch>:<sample id>"s; the one after it starts collating."""
        rows, batch = self._pending
        self._pending = self._ahead()
        return batch.result(), [f"{r['epoch']}:{r['sample_id']}" for r in rows]

    def position(self) -> dict[str, Any]:
        """Where a resumed stage starts: at the micro-batch taken ahead, which has not trained."""
        return self.feed.position(self._pending[0][0] if self._pending else None)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class StoreIterable(torch.utils.data.IterableDataset):
    """Padded batches from part files for a plain PyTorch ``DataLoader(ds, batch_size=None)``, outside
    Ray. Files are split across ``world_size`` ranks and the loader's workers (file i goes to shard
    i mod shards), so give it at least as many files as shards."""

    def __init__(self, files: list[str], batch_tokens: int, hidden_size: int, rank: int = 0, world_size: int = 1):
        super().__init__()
        self.files, self.batch_tokens, self.hidden_size = list(files), batch_tokens, hidden_size
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker = torch.utils.data.get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        shard, shards = self.rank * workers + worker_id, self.world_size * workers
        yield from pad_batches(iter_rows(self.files[shard::shards]), self.batch_tokens, self.hidden_size)
