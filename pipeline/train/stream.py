"""A training stage's rows as one Ray Data stream that spans its epochs.

The stream reads the stage's training parts (``pipeline.train.inputs.TrainParts``) epoch after epoch:
the parts in an order permuted from (seed, epoch), each part's rows shuffled from (seed, epoch, part)
and numbered in that order. Every row carries ``epoch``, ``part`` and ``row``: its place in the stream.
``ROWS_PER_BLOCK``-row blocks reach the ranks through ``streaming_split(world, equal=False)``
(``pipeline.train.inputs.data_config``). The split gives each block to the rank with the fewest rows so
far, and every block but the stream's last is full, so blocks are dealt round robin: rank r's rows are
a function of the stream alone.

One execution serves a stage. A new one starts only after a worker-group restart, on a resume, or when
a stage outlives the epochs its stream was sized for (``epochs_hint``). Each starts where the ranks
are: before any rank reads, rank 0 sets the start (``StreamStart``) to the first row of its block in
the round of the furthest-behind rank, and every rank skips the rows it has trained on from there
(``pipeline.train.batches.ShardFeed.position``). The read items are made from the start when the
execution begins. A round's first block of the stream it continues, dealt round robin again, gives
every rank the blocks it would have had: a resume reads no row before the furthest-behind rank's round.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.data.parts import CARRIED
from pipeline.train.inputs import TrainParts, reblock, select_rows

POSITION = ("epoch", "part", "row")  # the stream columns each row carries


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The order in which epoch ``epoch`` reads the stage's ``count`` parts."""
    order = list(range(count))
    random.Random(f"parts-{seed}-{epoch}").shuffle(order)
    return order


def first_start(epoch: int, epochs: int) -> dict[str, Any]:
    """A stream that starts with ``epoch`` and is sized for ``epochs`` epochs."""
    return {"epoch": epoch, "part": None, "row": 0, "skips": [], "end": epoch + epochs}


def epochs_hint(steps: int, micro_batches: int, world: int, batch_tokens: int, rows: int, mean_length: float) -> int:
    """How many epochs a stage of ``steps`` steps of ``micro_batches`` micro-batches reads, with room:
    a rank's micro-batch holds about ``batch_tokens`` / ``mean_length`` rows, fewer with padding."""
    per_step = micro_batches * world * batch_tokens / max(mean_length, 1.0)
    return math.ceil(1.25 * steps * per_step / max(rows, 1)) + 1


class StreamStart:
    """Where the stage's next stream execution starts: set by rank 0 before the ranks read, read by the
    task that makes the read items. Run as a Ray actor with no CPU of its own (training runs it as part
    of the stage's ``pipeline.train.channel.StageChannel``)."""

    def __init__(self) -> None:
        self.start: dict[str, Any] | None = None

    def set_stream_start(self, start: dict[str, Any]) -> None:
        self.start = dict(start)

    def stream_start(self) -> dict[str, Any] | None:
        return self.start


def stream_items(_: dict, count: int, seed: int, start: Any) -> list[dict[str, int]]:
    """The read items of an execution, from ``start`` (the ``StreamStart`` actor's) to its end epoch:
    each part of each epoch in that epoch's order, the first one from its start row."""
    import ray

    at = ray.get(start.stream_start.remote())
    if at is None:  # rank 0 sets it before any rank reads (pipeline.train.batches.ShardFeed)
        raise RuntimeError("the training stream ran before rank 0 said where it starts")
    items = []
    for epoch in range(at["epoch"], at["end"]):
        order = epoch_order(count, seed, epoch)
        if epoch == at["epoch"] and at["part"] is not None:
            order = order[order.index(at["part"]) :]
        for part in order:
            first = at["row"] if (epoch, part) == (at["epoch"], at["part"]) else 0
            items.append({"stream_epoch": epoch, "stream_part": part, "stream_from": first})
    return items


def shape_part(table: pa.Table, seed: int, held_out: list[str]) -> pa.Table:
    """A part's rows as the stream gives them (a whole part, its read item's ``CARRIED`` columns on its
    rows): its training rows, shuffled from (seed, epoch, part), numbered in that order, from the
    item's first row on."""
    place = [table[name][0].as_py() if table.num_rows else 0 for name in CARRIED]
    table = table.drop_columns(list(CARRIED))
    if held_out:
        table = select_rows(table, held_out, keep=False)
    epoch, part, first = place
    order = list(range(table.num_rows))
    random.Random(f"rows-{seed}-{epoch}-{part}").shuffle(order)
    table = table.take(pa.array(order[first:], pa.int64()))
    rows = table.num_rows
    values = (np.full(rows, epoch), np.full(rows, part), np.arange(first, first + rows))
    for name, column in zip(POSITION, values):
        table = table.append_column(name, pa.array(column.astype(np.int64)))
    return table


def train_stream(parts: TrainParts, seed: int, start: Any):
    """The stage's training rows (module docstring) as a dataset; ``start``: the stage's ``StreamStart``
    actor, read when each execution begins."""
    import ray

    one = ray.data.from_items([{"stream": 0}])
    items = one.flat_map(stream_items, fn_kwargs={"count": parts.count, "seed": seed, "start": start})
    items = items.repartition(target_num_rows_per_block=1, strict=True)  # a read task per part
    shaped = parts.tables(items).map_batches(
        shape_part, batch_size=None, batch_format="pyarrow", fn_kwargs={"seed": seed, "held_out": parts.held_out}
    )
    stream = reblock(shaped)
    stream.context.target_max_block_size = None  # a part stays one block until shaped: its shuffle sees all of it
    return stream
