"""The data a training stage reads: held-out split, reduced vocabulary, and each worker's feed.

Each Ray Train worker reads its shard of the stage's stream (``pipeline.train.stream``: blocks dealt
round robin, so a rank reads ~1/world of the rows). ``ShardFeed`` turns a shard into micro-batches:

- **Each rank packs its own rows.** A micro-batch is as many of the rank's next rows as fit
  ``batch_tokens`` (B * T_max), whatever the other ranks' rows, and every rank trains the same
  number of micro-batches a step (``train.method.grad_accum``). The loss is normalised by the ranks'
  total token count (``griffin.losses``), so every token weighs the same on every rank. The only
  agreement is a flag a step, on the host: when one rank's share of an execution cannot fill a step,
  every rank starts the next execution together (the rows they had read of it and not trained are
  left: at most ``DRIFT_ROWS``, a step and a block a rank).
- **Deterministic.** The stream runs with ``preserve_order``: the same blocks reach the same rank in
  the same order on every attempt, and a rank's micro-batches are a function of its rows alone. A
  checkpoint's data position holds every rank's place (the round of its block and the row in it):
  a resumed stage starts its stream at rank 0's block of the furthest-behind rank's round, and each
  rank skips exactly the rows it had trained on, which the stream leaves empty (never read again).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from griffin.config import LossWindow
from griffin.losses import ShiftedBatch, shift_batch
from pipeline.config import TrainSection
from pipeline.data.store import iter_rows, pad_batches, part_files, table_rows
from pipeline.train.inputs import ROWS_PER_BLOCK
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
    with its ``epoch``, its block's ``round`` (the rank's n-th block of the execution: the stream's
    block n * world + rank) and its ``offset`` in the block; ``feed.received`` counts each block and
    keeps its place (the (epoch, part, row) of its first row). Empty rows (a stream row not read,
    ``pipeline.train.stream.shape_part``) hold their place in the blocks and are not given, nor are
    the rows this rank trained on before (its first ``feed.skip``, which the stream leaves empty)."""
    for table in shard.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1):
        if not table.num_rows:
            continue
        epochs = table["epoch"].to_numpy()
        block = feed.received(epochs, table, {key: int(table[key][0].as_py()) for key in POSITION})
        first = max(0, feed.skip - block * ROWS_PER_BLOCK)  # the block's first row this rank has not trained on
        for offset, (row, epoch) in enumerate(zip(table_rows(table), epochs)):
            if offset >= first and row["seq_len"]:
                row.update(epoch=int(epoch), round=block, offset=offset)  # table_rows makes a new dict per row
                yield row


def taken_slots(row: dict) -> int:
    """How many of its share's rows (by place, empty ones too) a rank has taken with ``row``."""
    return row["round"] * ROWS_PER_BLOCK + row["offset"] + 1


# How many rows of an execution a rank may take beyond the furthest-behind rank before it packs fewer
# (down to a row a micro-batch). Ranks that pack their own rows drift apart (a random walk); this keeps
# the gap within DRIFT_ROWS rows and one step's rows (at most grad_accum x batch_tokens tokens): what
# the stream's split holds for the rank behind, and what a resume reads again.
DRIFT_ROWS = 2 * ROWS_PER_BLOCK


def fitting(lengths: Iterable[int], budget: int) -> int:
    """How many rows of these lengths, in order, make one micro-batch of at most ``budget`` tokens
    padded (B * T_max); a row longer than the budget goes alone. 0 when there are none."""
    n, longest = 0, 0
    for length in lengths:
        if n and (n + 1) * max(longest, length) > budget:
            return n
        longest, n = max(longest, length), n + 1
    return n


class HostCollective:
    """The feed's agreements across the ranks (a flag a step, the ranks' places at a checkpoint), on the
    host: gloo, a group of its own when the default is NCCL, so that they never wait for the device.
    Every rank makes one (``new_group`` is a collective)."""

    def __init__(self, world: int):
        import torch.distributed as dist

        self.world = world
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def barrier(self) -> None:
        torch.distributed.barrier(group=self.group)

    def most(self, values: list[int]) -> list[int]:
        """Each value's largest over the ranks."""
        most = torch.tensor(values, dtype=torch.int64)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return most.tolist()

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values``, by rank."""
        out = [torch.zeros(len(values), dtype=torch.int64) for _ in range(self.world)]
        torch.distributed.all_gather(out, torch.tensor(values, dtype=torch.int64), group=self.group)
        return [o.tolist() for o in out]


class ShardFeed:
    """This rank's training rows from the stage's stream (``pipeline.train.stream``), a step's
    micro-batches at a time, each packed from this rank's own rows to ``batch_tokens`` (module
    docstring). ``start``: where the stream starts (``first_start``, or a checkpoint's ``position``);
    ``stream_start``: the stage's ``StreamStart`` actor (its ``StageChannel``), which rank 0 tells
    before the ranks read; ``collective``: how the ranks agree (default ``HostCollective``)."""

    def __init__(self, shard, rank, world, device, train: TrainSection, stream_start, start, epochs, collective=None):
        self.shard, self.rank, self.world, self.device = shard, rank, world, device
        self.batch_tokens, self.stream_start, self.epochs = train.batch_tokens, stream_start, epochs
        self.collective = collective or (HostCollective(world) if world > 1 else None)
        self.block_bytes: list[int] = []  # bytes of every block this rank received, this attempt
        self.per_epoch: dict[int, dict[str, int]] = {}  # rows and bytes received of each epoch, this attempt
        self.read_again = 0  # bytes of rows trained on before an execution's start that it read again, this attempt
        self._open(start)

    def _open(self, start: dict[str, Any]) -> None:
        """Start an execution at ``start``: rank 0 says where, every rank waits for that. Each rank's
        first rows there, the ones it trained on before (its own count: ranks take rows at their own
        pace), come empty and are passed over (``shard_rows``). A rank that had read its share to the
        end finds it used up at its next ``take``, as it would have."""
        import ray

        skips = start.get("skips") or [start.get("skip", 0)] * self.world  # "skip": lockstep checkpoints
        start = {**start, "skips": skips}
        if self.rank == 0:
            ray.get(self.stream_start.set_stream_start.remote(start))
        if self.collective is not None:
            self.collective.barrier()
        if hasattr(self, "_rows"):
            self.close()  # the execution before, which this rank leaves unfinished
        self.start, self.steps_taken, self._ahead = start, 0, []
        self.places: list[dict[str, int]] = []  # the place of each block of this execution, by round
        self.skip = skips[self.rank]  # the rows of its share it trained on before: the stream leaves them empty
        self._rows = shard_rows(self.shard, self)
        # rows taken since the execution's first round, and how many beyond DRIFT_ROWS this rank is ahead
        self.taken, self.excess = skips[self.rank], max(0, skips[self.rank] - min(skips) - DRIFT_ROWS)

    def received(self, epochs: np.ndarray, table: pa.Table, place: dict[str, int]) -> int:
        """Count a block as it arrives (and the rows in it this rank trained on before that came with
        their features: none, the stream leaves them empty); its round."""
        nbytes, trained = table.nbytes, table.slice(0, max(0, self.skip - len(self.places) * ROWS_PER_BLOCK))
        self.read_again += trained.filter(pc.greater(trained["seq_len"], 0)).nbytes
        self.block_bytes.append(nbytes)
        for epoch, rows in zip(*np.unique(epochs, return_counts=True)):
            seen = self.per_epoch.setdefault(int(epoch), {"epoch": int(epoch), "rows": 0, "bytes": 0})
            seen["rows"] += int(rows)
            seen["bytes"] += nbytes * int(rows) // len(epochs)
        self.places.append(place)
        return len(self.places) - 1

    @property
    def finished(self) -> list[dict[str, int]]:
        """The epochs this rank has read to the end (a row of a later one has arrived)."""
        last = max(self.per_epoch, default=0)
        return [seen for epoch, seen in sorted(self.per_epoch.items()) if epoch < last]

    def _lookahead(self) -> Iterator[dict]:
        """This rank's next rows, from those taken ahead on, reading more as they are asked for."""
        for n in itertools.count():
            if n == len(self._ahead):
                row = next(self._rows, None)
                if row is None:
                    return
                self._ahead.append(row)
            yield self._ahead[n]

    def _pack(self, count: int) -> list[list[dict]]:
        """Up to ``count`` micro-batches of this rank's next rows, each as many as fit the budget; while
        this rank is more than ``DRIFT_ROWS`` ahead, that many fewer (at least one row a micro-batch)."""
        step: list[list[dict]] = []
        while len(step) < count:
            fit = fitting((int(row["seq_len"]) for row in self._lookahead()), self.batch_tokens)
            if fit == 0:
                break
            trim = min(fit - 1, self.excess)
            fit, self.excess = fit - trim, self.excess - trim
            step.append(self._ahead[:fit])
            self._ahead = self._ahead[fit:]
        return step

    def _most(self, values: list[int]) -> list[int]:
        return values if self.collective is None else self.collective.most(values)

    def take(self, count: int) -> list[list[dict]]:
        """The next step's ``count`` micro-batches. When any rank's share of this execution cannot fill
        the step, every rank starts the next execution and takes the step there. One all-reduce a step
        carries that flag and the rows the furthest-behind rank has taken."""
        step = self._pack(count)
        used_up, taken = len(step) < count, taken_slots(step[-1][-1]) if step else self.taken
        fresh = self.steps_taken == 0 and self.start["part"] is None  # an execution from an epoch's start
        worst, behind = self._most([2 if used_up and fresh else int(used_up), -taken])
        if worst == 2:
            raise ValueError(
                f"a rank's share of the training rows ({self.world} ranks) does not fill one step of {count} "
                f"micro-batches of train.batch_tokens={self.batch_tokens}: the store's train split is too small "
                "for this many workers"
            )
        if worst == 1:
            self._open(first_start(self.start["end"], self.epochs))
            return self.take(count)
        self.steps_taken, self.taken, self.excess = self.steps_taken + 1, taken, max(0, taken + behind - DRIFT_ROWS)
        return step

    def position(self, pending: list[list[dict]] | None) -> dict[str, Any]:
        """Where a resumed stage starts, a collective (every rank calls it; rank 0's answer is the one to
        keep): at ``pending``'s first row (the step taken ahead, not trained) or each rank's next row.
        The stream restarts at the first block of the round the furthest-behind rank is in (rank 0's
        block of that round), and each rank skips its own rows from there; or the next execution."""
        row = pending[0][0] if pending else self._peek()
        mine = [row["round"], row["offset"], 0] if row is not None else [len(self.places), 0, 1]
        ranks = [mine] if self.collective is None else self.collective.gather(mine)
        if all(at_end for _, _, at_end in ranks):
            return first_start(self.start["end"], self.epochs)
        first = min(block for block, _, _ in ranks)
        skips = [(block - first) * ROWS_PER_BLOCK + offset for block, offset, _ in ranks]
        place = self.places[first] if self.rank == 0 else {}
        return {**place, "skips": skips, "end": self.start["end"]}

    def close(self) -> None:
        """End this rank's reading of the execution (Ray Data's iterator tells its split it is done)
        while Ray is up: the feed and its rows' generator hold each other, so the garbage collector
        would close it at some later time, possibly after Ray has shut down."""
        self._rows.close()

    def _peek(self) -> dict | None:
        return next(self._lookahead(), None)


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
    """``feed``'s steps. A step's rows are taken on the training thread one step ahead: taking has a
    collective (the used-up flag), and every rank must issue its collectives in the same order. Its
    micro-batches are collated (decoded, padded, shifted, copied to the device) on a background thread
    one micro-batch ahead of training, so the device holds the micro-batch that trains and the next."""

    def __init__(self, feed: ShardFeed, hidden_size: int, window: LossWindow, layers: bool, steps: int, micro: int):
        from concurrent.futures import ThreadPoolExecutor

        self.feed, self.shape, self.left, self.micro = feed, (hidden_size, window, layers), steps, micro
        cuda = torch.device(feed.device).type == "cuda"  # the thread's pinned copies go to this rank's GPU
        setup = {"initializer": torch.cuda.set_device, "initargs": (feed.device,)} if cuda else {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="collate", **setup)
        self._step = self._take()  # the rows of the step that trains next
        self._collating = self._collate(self._step[0]) if self._step else None  # (rows, their collation)

    def _take(self) -> list[list[dict]] | None:
        """The next step's micro-batches' rows; None past the stage's last step."""
        if self.left == 0:
            return None
        self.left -= 1
        return self.feed.take(self.micro)

    def _collate_now(self, rows: list[dict]) -> ShiftedBatch:
        return collate(rows, self.shape[0], self.feed.device, *self.shape[1:])

    def _collate(self, rows: list[dict]):
        return rows, self.pool.submit(self._collate_now, rows)

    def next(self) -> tuple[Iterator[ShiftedBatch], list[list[str]]]:
        """The next step's micro-batches, collated as they are consumed, and the "<epoch>:<sample id>"s
        of each; the rows of the step after it are taken now."""
        step, self._step = self._step, self._take()
        return self._batches(step), [[f"{r['epoch']}:{r['sample_id']}" for r in rows] for rows in step]

    def _batches(self, step: list[list[dict]]) -> Iterator[ShiftedBatch]:
        """Each micro-batch of ``step``, the next one's collation started as it is handed out."""
        for i, rows in enumerate(step):
            pending, future = self._collating or (None, None)
            batch = future.result() if pending is rows else self._collate_now(rows)
            after = step[i + 1] if i + 1 < len(step) else (self._step[0] if self._step else None)
            self._collating = self._collate(after) if after is not None else None
            yield batch

    def position(self) -> dict[str, Any]:
        """Where a resumed stage starts (a collective): at the step taken ahead, which has not trained."""
        return self.feed.position(self._step)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.feed.close()


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
