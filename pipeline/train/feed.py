"""A training stage's input as Ray Data datasets, split across the Ray Train workers.

``train.features: offline`` reads the feature store: a Ray Data task per part file of the manifest,
only the columns the draft reads (a single-feature draft never reads the multi-layer column).
``online`` computes the same rows as training reads them: the featurize stage's target actors
(``PartFeatures``, with featurize's pool size and resources) run over the same planned parts a
featurize would write, and nothing is stored. Either way the held-out rows (by sample id) form the
``eval`` dataset (none without held-out rows) and the rest the ``train`` dataset, in the same order,
cut into ``ROWS_PER_BLOCK``-row blocks.

``data_config()`` splits both with ``streaming_split(world, equal=True)`` (Ray Train's
``DataConfig``), so each rank reads ~1/world of the rows, with ``preserve_order`` so that the same
rows reach the same rank in the same order on every attempt (exact resume; ``pipeline.train.batches``).

A split runs its dataset anew for every epoch, worker-group restart and stage: offline that reads the
parts again, online it starts the target actors again (each loads the target) and recomputes every
feature. ``materialize()`` runs both datasets once on the driver instead (``train.materialize``;
``auto``: when ``estimated_bytes`` fits a quarter of the object store); the splits then hand out the
same blocks in the same order, so ranks receive exactly the rows a streamed run gives them.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import RunConfig
from pipeline.data.heldout import heldout_parts
from pipeline.data.layout import parts_dataset

BASE_COLUMNS = ("sample_id", "input_ids", "loss_mask", "seq_len", "hidden")
ROWS_PER_BLOCK = 16
MATERIALIZE_SHARE = 0.25  # of the cluster's object-store memory: Ray Data's own streaming needs the rest


def data_config():
    """Ray Train's dataset split, deterministic (locality hints give way to order)."""
    from ray.train import DataConfig

    options = DataConfig.default_ingest_options()
    options.preserve_order = True
    return DataConfig(datasets_to_split="all", execution_options=options)


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
    same way whichever source made them, alternately in small runs of neighbouring (similar-length)
    rows, which keeps the ranks' lockstep micro-batches full."""
    return dataset.repartition(target_num_rows_per_block=ROWS_PER_BLOCK, strict=True)


def _filtered(base, ids: list[str], keep: bool):
    return reblock(
        base.map_batches(select_rows, batch_size=None, batch_format="pyarrow", fn_kwargs={"ids": ids, "keep": keep})
    )


def stored_datasets(part_ids: dict[str, list[str]], dtype: str, layers: bool, eval_ids: set[str]) -> dict[str, Any]:
    """``train`` and ``eval`` datasets of the store's parts (``part_ids``: each part file's sample ids, in
    read order), a read task per part (``pipeline.data.layout.parts_dataset``): each reads only the parts
    that hold its rows (``pipeline.data.heldout.heldout_parts``), so the held-out set costs its own parts."""
    held, train = heldout_parts(part_ids, eval_ids)
    ids, columns = sorted(eval_ids), feature_columns(dtype, layers)
    datasets = {"train": _filtered(parts_dataset(train, columns), ids, keep=False)}
    return datasets | ({"eval": _filtered(parts_dataset(held, columns), ids, keep=True)} if ids else {})


def online_datasets(cfg: RunConfig, key: dict[str, Any], samples: list, eval_ids: set[str]) -> dict[str, Any]:
    """``train`` and ``eval`` datasets whose features the target actors compute as they are read: the
    parts ``griffin featurize`` would write (same grouping and order), each cut to its train or its
    held-out samples before the target sees it, so no held-out row is featurized for training."""
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

    def dataset(keep: bool):
        parts = [[s for s in group if (s.sample_id in eval_ids) == keep] for group in groups]
        return reblock(part_actor_dataset(cfg, PartFeatures, [pack_part(p) for p in parts if p], kwargs))

    return {"train": dataset(False), **({"eval": dataset(True)} if eval_ids else {})}


def online_bundles(cfg: RunConfig) -> list[dict[str, float]]:
    """The resources an online stage holds at once: a bundle per training worker and per feature actor."""
    worker = {"CPU": cfg.train.cpus_per_worker, **({"GPU": 1.0} if cfg.train.use_gpu else {})}
    actor = {
        "CPU": cfg.features.cpus_per_actor,
        **({"GPU": cfg.features.gpus_per_actor} if cfg.features.gpus_per_actor else {}),
    }
    return [worker] * cfg.train.num_workers + [actor] * cfg.features.num_actors


def check_online_fits(cfg: RunConfig, wait_s: float) -> None:
    """Refuse an online stage the cluster cannot hold at once (its workers would wait for feature actors
    that never start), after asking the autoscaler for it (a no-op without one) and waiting up to
    ``wait_s`` for the cluster to grow."""
    import time

    import ray
    from ray.autoscaler.sdk import request_resources

    bundles = online_bundles(cfg)
    needs = {key: sum(bundle.get(key, 0.0) for bundle in bundles) for key in ("CPU", "GPU")}
    request_resources(bundles=bundles)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            have = ray.cluster_resources()
            short = {k: (n, have.get(k, 0.0)) for k, n in needs.items() if n > have.get(k, 0.0)}
            if not short:
                return
            if time.monotonic() >= deadline:
                raise ValueError(_too_small(cfg, short))
            time.sleep(5.0)
    finally:
        request_resources(bundles=[])  # the request was for this check: the stage's tasks ask for what they use


def _too_small(cfg: RunConfig, short: dict[str, tuple[float, float]]) -> str:
    return (
        "train.features=online holds the training workers and the feature actors at once: "
        + "; ".join(f"{n:g} {k} needed, the cluster has {have:g}" for k, (n, have) in short.items())
        + f" (train.num_workers={cfg.train.num_workers}, train.cpus_per_worker={cfg.train.cpus_per_worker:g}, "
        f"train.use_gpu={cfg.train.use_gpu}; features.num_actors={cfg.features.num_actors}, features."
        f"cpus_per_actor={cfg.features.cpus_per_actor:g}, features.gpus_per_actor={cfg.features.gpus_per_actor:g}). "
        "Lower them, grow the cluster, or featurize a store first (`griffin featurize`, then train.features=offline)"
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


def materialize(datasets: dict[str, Any]) -> dict[str, Any]:
    """Each dataset run once, in order, its blocks held in the object store for as long as the
    returned datasets live (one block per bundle, as the stream delivers them: the split assigns rows
    to ranks as it would from the stream)."""
    for dataset in datasets.values():
        dataset.context.execution_options.preserve_order = True
    return {name: dataset.materialize() for name, dataset in datasets.items()}
