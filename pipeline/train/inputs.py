"""A training stage's input: its training parts and its held-out rows, split across the Ray Train workers.

``train.features: offline`` reads the feature store: a Ray Data task per part file, only the columns
the draft reads (a single-feature draft never reads the multi-layer column). ``online`` computes the
same rows as training reads them: the featurize stage's target actors (``PartFeatures``, with
featurize's pool size and resources) run over the same planned parts a featurize would write, and
nothing is stored. Either way the training parts (``TrainParts``) feed the stage's stream
(``pipeline.train.stream``), and the held-out rows (by sample id) form the ``eval`` dataset (none
without held-out rows), cut into ``ROWS_PER_BLOCK``-row blocks.

``data_config()`` splits both with ``streaming_split(world, equal=False)``, so each rank reads
~1/world of the rows, with ``preserve_order`` so that the same rows reach the same rank in the same
order on every attempt (exact resume).

``materialized_parts()`` reads (online: featurizes) each training part once on the driver and holds it
in the object store, and ``materialize()`` the held-out rows, for every epoch, restart and stage
(``train.materialize``; ``auto``: when ``estimated_bytes`` fits a quarter of the object store); the
stream then reads the held blocks, so ranks receive exactly the rows a streamed run gives them.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import RunConfig
from pipeline.data.heldout import heldout_parts
from pipeline.data.part_files import parts_dataset
from pipeline.data.parts import CARRIED, carry
from pipeline.runtime import describe_shortfall, resource_shortfall

BASE_COLUMNS = ("sample_id", "input_ids", "loss_mask", "seq_len", "hidden")
ROWS_PER_BLOCK = 16
MATERIALIZE_SHARE = 0.25  # of the cluster's object-store memory: Ray Data's own streaming needs the rest


def data_config():
    """Ray Train's dataset split, deterministic (locality hints give way to order), and unequal: blocks
    are dealt as they come (``pipeline.train.stream``), none held back to even the ranks out at the end."""
    from ray.train import DataConfig

    class DealtSplit(DataConfig):
        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            output: list[dict[str, Any]] = [{} for _ in range(world_size)]
            for name, dataset in datasets.items():
                dataset = dataset.copy(dataset)
                dataset.set_name(name)
                dataset.context.execution_options = self._resolve_execution_options(name)
                for rank, split in enumerate(dataset.streaming_split(world_size, equal=False)):
                    output[rank][name] = split
            return output

    options = DataConfig.default_ingest_options()
    options.preserve_order = True
    return DealtSplit(execution_options=options)


def feature_columns(dtype: str, layers: bool) -> list[str]:
    """The store columns a draft reads: the final feature (+ fp8 scales), and the feature layers of a
    multi-layer draft."""
    fp8 = dtype == "fp8"
    return [
        *BASE_COLUMNS,
        *(["scales"] if fp8 else []),
        *((["layers"] + (["layer_scales"] if fp8 else [])) if layers else []),
    ]


def select_rows(table: pa.Table, ids: list[str], keep: bool) -> pa.Table:
    """The rows of ``table`` whose sample id is in ``ids`` (keep) or not."""
    inside = pc.is_in(table["sample_id"], value_set=pa.array(ids, pa.string()))
    return table.filter(inside if keep else pc.invert(inside))


def reblock(dataset):
    """``ROWS_PER_BLOCK``-row blocks, in order: the split hands out blocks, so rows reach the ranks the
    same way whichever source made them, dealt round robin in small runs."""
    return dataset.repartition(target_num_rows_per_block=ROWS_PER_BLOCK, strict=True)


class TrainParts:
    """A stage's training parts, by index into the stage's part list (the store's parts holding training
    rows in read order, or the training groups featurize would write, in plan order: the same list
    either way), shuffled from ``seed`` (``train.seed``). ``counts``: each part's training rows (a
    stored part's rows less its held-out ones, a planned part's samples), from which the stream lays
    out its rows (``pipeline.train.stream``).
    ``tables(items)`` turns a dataset of read items (``CARRIED`` columns, ``stream_skip``) into each
    item's rows of its part (``needed_rows``) as one table, a ``train_index`` column naming each row's
    place among the part's training rows, the item's columns carried onto its rows."""

    def __init__(self, counts: list[int], seed: int, tables, holds: Any = None):
        self.counts, self.seed, self.tables = list(counts), seed, tables
        self.holds = holds  # what keeps materialized blocks alive for as long as these parts are read

    @property
    def count(self) -> int:
        return len(self.counts)


def part_order(seed: int, epoch: int, part: int, count: int) -> list[int]:
    """The order in which epoch ``epoch`` reads part ``part``'s ``count`` training rows (by index)."""
    order = list(range(count))
    random.Random(f"rows-{seed}-{epoch}-{part}").shuffle(order)
    return order


def needed_rows(item: dict[str, np.ndarray], seed: int) -> list[int] | None:
    """The training rows (indices, ascending) an item's stream rows hold: from its first stream row on,
    less the rows every rank skips (``stream_skip``, stream rows of a resume); None when that is all."""
    epoch, part, first, count = (int(item[name][0]) for name in CARRIED)
    skip = {int(k) for k in str(item["stream_skip"][0]).split(",") if k}
    if not first and not skip:
        return None
    order = part_order(seed, epoch, part, count)
    return sorted(order[k] for k in range(first, count) if k not in skip)


def stored_parts(part_ids: dict[str, list[str]], dtype: str, layers: bool, eval_ids: set[str], seed: int) -> TrainParts:
    """The store's parts that hold training rows (``pipeline.data.heldout.heldout_parts``), a read task
    per part, only the columns the draft reads, only the rows the stream asks for (``needed_rows``)."""
    _, files = heldout_parts(part_ids, eval_ids)
    mixed = sorted(i for f in files for i in part_ids[f] if i in eval_ids)
    columns = feature_columns(dtype, layers)
    counts = [sum(i not in eval_ids for i in part_ids[f]) for f in files]

    def tables(items):
        kwargs = {"files": files, "columns": columns, "held_out": mixed, "seed": seed}
        return items.map_batches(read_part, batch_size=1, batch_format="numpy", fn_kwargs=kwargs)

    return TrainParts(counts, seed, tables)


def online_parts(cfg: RunConfig, key: dict[str, Any], samples: list, eval_ids: set[str]) -> tuple[TrainParts, Any]:
    """The training parts ``griffin featurize`` would write (same grouping and order), their features
    computed by the target actors as they are read (only the rows the stream asks for), and the
    held-out dataset alike: no held-out row is featurized for training."""
    import ray

    from pipeline.data.featurize import PartFeatures, group_parts, pack_part, target_part
    from pipeline.data.parts import part_actor_dataset

    layers = key.get("feature_layers", ())
    groups = group_parts(samples, cfg, key["hidden_size"], len(layers), eval_ids)
    kwargs = dict(
        target=cfg.target.model_dump(),
        dtype=cfg.features.dtype,
        batch_tokens=cfg.features.batch_tokens,
        fingerprint=target_part(key),
        layers=tuple(layers),
    )
    train = [p for g in groups if (p := [s for s in g if s.sample_id not in eval_ids])]
    held = [pack_part(p) for g in groups if (p := [s for s in g if s.sample_id in eval_ids])]
    packed = [ray.put(pack_part(part)) for part in train]  # read by index as the stream asks for each part

    def tables(items):
        items = items.map_batches(
            packed_part, batch_size=1, batch_format="numpy", fn_kwargs={"packed": packed, "seed": cfg.train.seed}
        )
        return part_actor_dataset(cfg, PartFeatures, items, kwargs)

    parts = TrainParts([len(p) for p in train], cfg.train.seed, tables, holds=packed)
    return parts, (reblock(part_actor_dataset(cfg, PartFeatures, held, kwargs)) if held else None)


def stored_eval(part_ids: dict[str, list[str]], dtype: str, layers: bool, eval_ids: set[str]):
    """The held-out rows as a dataset, read from the parts that hold them (None without any)."""
    if not eval_ids:
        return None
    held, _ = heldout_parts(part_ids, eval_ids)
    base = parts_dataset(held, feature_columns(dtype, layers))
    selected = base.map_batches(
        select_rows, batch_size=None, batch_format="pyarrow", fn_kwargs={"ids": sorted(eval_ids), "keep": True}
    )
    return reblock(selected)


STREAM_TASK_CPUS = 1.0  # an offline stage's stream reads its parts in Ray Data tasks while the workers train


def stage_bundles(cfg: RunConfig) -> list[dict[str, float]]:
    """The resources a stage holds at once: a bundle per training worker, and per feature actor
    (online) or a CPU for the stream's read tasks (offline)."""
    worker = {"CPU": cfg.train.cpus_per_worker, **({"GPU": 1.0} if cfg.train.use_gpu else {})}
    if cfg.train.features == "offline":
        return [worker] * cfg.train.num_workers + [{"CPU": STREAM_TASK_CPUS}]
    actor = {
        "CPU": cfg.features.cpus_per_actor,
        **({"GPU": cfg.features.gpus_per_actor} if cfg.features.gpus_per_actor else {}),
    }
    return [worker] * cfg.train.num_workers + [actor] * cfg.features.num_actors


def check_stage_fits(cfg: RunConfig, wait_s: float) -> None:
    """Refuse a stage the cluster cannot hold at once (its workers would wait for feature actors or
    read tasks that never start, behind Ray Data's warning), after asking the autoscaler for it (a
    no-op without one) and waiting up to ``wait_s`` for the cluster to grow."""
    import time

    from ray.autoscaler.sdk import request_resources

    bundles = stage_bundles(cfg)
    needs = {key: sum(bundle.get(key, 0.0) for bundle in bundles) for key in ("CPU", "GPU")}
    request_resources(bundles=bundles)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            if not (short := resource_shortfall(needs)):
                return
            if time.monotonic() >= deadline:
                raise ValueError(_too_small(cfg, short))
            time.sleep(5.0)
    finally:
        request_resources(bundles=[])  # the request was for this check: the stage's tasks ask for what they use


def _too_small(cfg: RunConfig, short: dict[str, tuple[float, float]]) -> str:
    online = cfg.train.features == "online"
    beside = (
        f"features.num_actors={cfg.features.num_actors}, features.cpus_per_actor={cfg.features.cpus_per_actor:g}, "
        f"features.gpus_per_actor={cfg.features.gpus_per_actor:g}"
        if online
        else f"{STREAM_TASK_CPUS:g} CPU for the stream's read tasks"
    )
    return (
        f"train.features={cfg.train.features} holds the training workers and "
        + ("the feature actors" if online else "the stream's read tasks")
        + " at once: "
        + describe_shortfall(short, "the cluster")
        + f" (train.num_workers={cfg.train.num_workers}, train.cpus_per_worker={cfg.train.cpus_per_worker:g}, "
        f"train.use_gpu={cfg.train.use_gpu}; {beside}). Lower them or grow the cluster (cluster.num_cpus on a local Ray)"
        + (", or featurize a store first (`griffin featurize`, then train.features=offline)" if online else "")
    )


def estimated_bytes(tokens: int, hidden_size: int, dtype: str, layers: int) -> int:
    """The in-memory size of ``tokens`` positions of the columns training reads: ids (int32) and mask
    (uint8), then H values per feature vector (the final feature and each of ``layers`` feature
    layers), 2 bytes each in bf16, or 1 byte plus a float32 scale per position in fp8."""
    per_vector = hidden_size + 4 if dtype == "fp8" else 2 * hidden_size
    return tokens * (5 + (1 + layers) * per_vector)


def should_materialize(setting: bool | str, size: int) -> bool:
    """``train.materialize``: yes, no, or (auto) when ``size`` bytes fit ``MATERIALIZE_SHARE`` of the
    cluster's object-store memory (spilling a larger one to disk would cost more than re-reading)."""
    if setting != "auto":
        return bool(setting)
    import ray

    return size <= MATERIALIZE_SHARE * ray.cluster_resources().get("object_store_memory", 0)


def materialize(dataset):
    """``dataset`` run once, in order, its blocks held in the object store for as long as the returned
    dataset lives (one block per bundle, as it would deliver them: the held-out rows reach the ranks
    as they would from the dataset itself)."""
    dataset.context.execution_options.preserve_order = True
    return dataset.materialize()


def materialized_parts(parts: TrainParts) -> TrainParts:
    """``parts`` read (or featurized) once, each held in the object store as one block, and read from
    there by index for every epoch, restart and stage."""
    import ray

    every = [read_item(i, count) for i, count in enumerate(parts.counts)]
    base = parts.tables(ray.data.from_items(every, override_num_blocks=parts.count))
    base.context.target_max_block_size = None  # a part is one block
    held = materialize(base)
    blocks = [ref for bundle in held.iter_internal_ref_bundles() for ref in bundle.block_refs]
    if len(blocks) != parts.count:
        raise RuntimeError(
            f"materialized {len(blocks)} blocks for {parts.count} training parts; set train.materialize=false"
        )

    def tables(items):
        kwargs = {"blocks": blocks, "seed": parts.seed}
        return items.map_batches(held_part, batch_size=1, batch_format="numpy", fn_kwargs=kwargs)

    return TrainParts(parts.counts, parts.seed, tables, holds=(held, blocks))


def read_item(part: int, count: int, epoch: int = 0, first: int = 0) -> dict[str, Any]:
    """A read item for a part's ``count`` training rows from its stream row ``first`` on (``CARRIED``
    columns), nothing skipped."""
    return dict(zip(CARRIED, (epoch, part, first, count)), stream_skip="")


def read_part(item: dict[str, np.ndarray], files: list[str], columns: list[str], held_out: list[str], seed: int):
    """The training rows of the part file an item names that its stream rows hold (``needed_rows``),
    ``columns`` only, each with its ``train_index``, the item's place carried on. A resume's part is
    read by row group (a row group a row: ``pipeline.data.store.write_part``), so the rows before its
    resume row, and the ones every rank skips, are not read."""
    import pyarrow.parquet as pq

    from pipeline.data.part_files import location_fs

    fs, path = location_fs(files[int(item["stream_part"][0])])
    with fs.open_input_file(path) as source:
        parquet = pq.ParquetFile(source)
        needed = needed_rows(item, seed)
        table = parquet.read(columns=columns) if needed is None else None  # a whole part: one read
        ids = None
        if held_out:  # a mixed part: its held-out rows found by sample id
            ids = (parquet.read(columns=["sample_id"]) if table is None else table)["sample_id"]
        train = _training_rows(ids, parquet.metadata.num_rows, held_out)  # (n,) file row of each training row
        if len(train) != int(item["stream_count"][0]):  # the stream's places would not be this file's rows
            raise RuntimeError(
                f"{path} holds {len(train)} training rows where the stage counted {int(item['stream_count'][0])}: "
                "the store changed while it trained; run the stage again"
            )
        if needed is None:
            index = np.arange(len(train))
            table = table if len(train) == table.num_rows else table.take(pa.array(train))
        else:
            index = np.asarray(needed, np.int64)
            table = _read_rows(parquet, train[needed], columns)
    return carry(table.append_column("train_index", pa.array(index, pa.int64())), item)


def _training_rows(ids: pa.ChunkedArray | None, rows: int, held_out: list[str]) -> np.ndarray:
    """The file rows of a part's ``rows`` rows that are training rows: all of them, less the held-out
    ones of a mixed part (found from its sample ids, ``ids``)."""
    every = np.arange(rows, dtype=np.int64)
    if not held_out:
        return every
    return every[~pc.is_in(ids, value_set=pa.array(held_out, pa.string())).to_numpy(False)]


def _read_rows(parquet, rows: np.ndarray, columns: list[str]) -> pa.Table:
    """File rows ``rows`` (ascending) of a part, reading only the row groups that hold them."""
    if not len(rows):
        return parquet.schema_arrow.empty_table().select(columns)
    sizes = [parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)]
    first = np.concatenate([[0], np.cumsum(sizes)])  # (G+1,) the first file row of each group
    group = np.searchsorted(first, rows, side="right") - 1  # (R,) the group of each row
    groups = np.unique(group)  # (g,) the groups read, in file order
    table = parquet.read_row_groups(groups.tolist(), columns=columns)
    at = np.concatenate([[0], np.cumsum([sizes[g] for g in groups])])  # where each read group starts
    return table.take(pa.array(at[np.searchsorted(groups, group)] + rows - first[group], pa.int64()))


def held_part(item: dict[str, np.ndarray], blocks: list[Any], seed: int) -> pa.Table:
    """The materialized part an item names, only the rows its stream rows hold, its place carried on."""
    import ray

    table = ray.get(blocks[int(item["stream_part"][0])])
    if (needed := needed_rows(item, seed)) is not None:
        table = table.filter(pc.is_in(table["train_index"], value_set=pa.array(needed, pa.int64())))
    return carry(table, item)


def packed_part(item: dict[str, np.ndarray], packed: list[Any], seed: int) -> pa.Table:
    """The planned part an item names, only the samples its stream rows hold, as one row for the target
    actors (``pack_part``'s columns, and each sample's ``train_index``), the item's place carried on."""
    import ray

    part = ray.get(packed[int(item["stream_part"][0])])
    needed = needed_rows(item, seed)
    index = np.arange(len(part["sample_id"])) if needed is None else np.asarray(needed, np.int64)
    cuts = np.concatenate([[0], np.cumsum(part["lengths"])])
    tokens = [np.arange(cuts[i], cuts[i + 1]) for i in index]
    flat = np.concatenate(tokens) if tokens else np.zeros(0, np.int64)
    row = {
        "index": pa.array([part["index"]], pa.int64()),
        "sample_id": pa.array([[part["sample_id"][i] for i in index]], pa.list_(pa.string())),
        "lengths": _one_list(np.asarray(part["lengths"])[index]),
        "input_ids": _one_list(part["input_ids"][flat]),
        "loss_mask": _one_list(part["loss_mask"][flat]),
        "train_index": _one_list(index.astype(np.int64)),
    }
    return carry(pa.table(row), item)


def _one_list(values: np.ndarray) -> pa.Array:
    """``values`` as a list column of one row (no Python lists in between)."""
    return pa.ListArray.from_arrays(pa.array([0, len(values)], pa.int32()), pa.array(values))
