"""A training stage's rows as one Ray Data stream that spans its epochs.

The stream reads the stage's training parts (``pipeline.train.inputs.TrainParts``) epoch after epoch:
the parts in an order permuted from (seed, epoch), each part's rows shuffled from (seed, epoch, part)
and numbered in that order. Every row carries ``epoch``, ``part`` and ``row``: its place in the stream.
``ROWS_PER_BLOCK``-row blocks reach the ranks through ``streaming_split(world, equal=False)``
(``pipeline.train.inputs.data_config``). The split gives each block to the rank with the fewest rows so
far, and every block but the stream's last is full, so blocks are dealt round robin: rank r's rows are
a function of the stream alone. The places are a function of each part's training row count, which the
driver knows (a store's part ids, a plan's samples): which rows a stream row holds is known before
any is read.

One execution serves a stage. A new one starts only after a worker-group restart, on a resume, or when
a stage outlives the epochs its stream was sized for (``epochs_hint``). Each starts where the ranks
are: before any rank reads, rank 0 sets the start (``StreamStart``) to the first row of its block in
the round of the furthest-behind rank, with the rows each rank has trained on from there (``skips``,
``pipeline.train.batches.ShardFeed.position``). The read items are made from the start when the
execution begins. A round's first block of the stream it continues, dealt round robin again, gives
every rank the blocks it would have had. Nothing trained on is read again: the first part's rows
before its start row are not in the stream, and the rows the ranks skip (``skipped_rows``) stay in it
as empty rows, holding their places, so that no read task reads them and no target actor featurizes
them. A stream row whose features came out non-finite (online) is an empty row too.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.data.parts import CARRIED, empty_rows
from pipeline.train.inputs import ROWS_PER_BLOCK, TrainParts, part_order, read_item, reblock

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


def stream_items(_: dict, counts: list[int], seed: int, start: Any) -> list[dict[str, Any]]:
    """The read items of an execution, from ``start`` (the ``StreamStart`` actor's) to its end epoch:
    each part of each epoch in that epoch's order, the first one from its start row, each with the
    stream rows every rank skips (``skipped_rows``)."""
    import ray

    at = ray.get(start.stream_start.remote())
    if at is None:  # rank 0 sets it before any rank reads (pipeline.train.batches.ShardFeed)
        raise RuntimeError("the training stream ran before rank 0 said where it starts")
    items = []
    for epoch in range(at["epoch"], at["end"]):
        order = epoch_order(len(counts), seed, epoch)
        if epoch == at["epoch"] and at["part"] is not None:
            order = order[order.index(at["part"]) :]
        for part in order:
            first = at["row"] if (epoch, part) == (at["epoch"], at["part"]) else 0
            items.append(read_item(part, counts[part], epoch, first))
    for i, skip in skipped_rows(items, at.get("skips") or []).items():
        items[i]["stream_skip"] = ",".join(map(str, skip))
    return items


def skipped_rows(items: list[dict[str, Any]], skips: list[int]) -> dict[int, list[int]]:
    """The stream rows each rank skips at the start of an execution (rank r its first ``skips[r]``
    rows: the ones it trained on before a resume), by item: its part's stream rows (indices). Blocks of
    ``ROWS_PER_BLOCK`` rows go to the ranks round robin from rank 0 (``pipeline.train.inputs.data_config``)."""
    world, skipped = len(skips), {}
    if not any(skips):
        return skipped
    horizon = world * ROWS_PER_BLOCK * math.ceil(max(skips) / ROWS_PER_BLOCK)  # past every skipped row
    slot = 0
    for i, item in enumerate(items):
        for row in range(item["stream_from"], item["stream_count"]):
            if slot >= horizon:
                return skipped
            block, within = divmod(slot, ROWS_PER_BLOCK)
            rank, rounds = block % world, block // world
            if rounds * ROWS_PER_BLOCK + within < skips[rank]:
                skipped.setdefault(i, []).append(row)
            slot += 1
    return skipped


def shape_part(table: pa.Table, seed: int) -> pa.Table:
    """A part's rows as the stream gives them (its read item's ``CARRIED`` columns on its rows, each
    row's ``train_index``): in the part's order from (seed, epoch, part), numbered in that order, from
    the item's first stream row on; a stream row whose row was not read (the rank it goes to had
    trained on it) or not made (online: non-finite features) holds an empty row (``empty_rows``)."""
    epoch, part, first, count = (table[name][0].as_py() for name in CARRIED)
    real = pc.greater(table["seq_len"], 0)  # not carry's empty row (no sample has 0 tokens: tokenizing skips them)
    where = dict(zip(table["train_index"].filter(real).to_pylist(), np.flatnonzero(real.to_numpy(False)).tolist()))
    table = table.drop_columns([*CARRIED, "train_index"])
    table = pa.concat_tables([table, empty_rows(table.schema, 1)])
    order = part_order(seed, epoch, part, count)[first:]
    table = table.take(pa.array([where.get(t, table.num_rows - 1) for t in order], pa.int64()))
    values = (np.full(len(order), epoch), np.full(len(order), part), np.arange(first, count))
    for name, column in zip(POSITION, values):
        table = table.append_column(name, pa.array(column.astype(np.int64)))
    return table


def train_stream(parts: TrainParts, start: Any):
    """The stage's training rows (module docstring) as a dataset; ``start``: the stage's ``StreamStart``
    actor, read when each execution begins."""
    import ray

    one = ray.data.from_items([{"stream": 0}])
    items = one.flat_map(stream_items, fn_kwargs={"counts": parts.counts, "seed": parts.seed, "start": start})
    items = items.repartition(target_num_rows_per_block=1, strict=True)  # a read task per part
    shaped = parts.tables(items).map_batches(
        shape_part, batch_size=None, batch_format="pyarrow", fn_kwargs={"seed": parts.seed}
    )
    stream = reblock(shaped)
    stream.context.target_max_block_size = None  # a part stays one block until shaped: its shuffle sees all of it
    return stream
