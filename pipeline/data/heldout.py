"""Which rows are held out, and which parts hold them (docs/design.md §5).

``held_out_ids``: the ``ceil(train.eval_fraction · n)`` sample ids with the smallest hash, stable as the
data grows. Featurize plans those samples into parts of their own (``pipeline.data.featurize.group_parts``),
so training reads its held-out set from those parts alone and its training rows from the others
(``heldout_parts``): neither scans the whole store for the other's rows. A part that mixes both (a
store made before, or held out at another fraction) is read by both and filtered.
"""

from __future__ import annotations

import hashlib
import math

import pyarrow.parquet as pq

from pipeline.data.store import part_files


def _hash(sample_id: str) -> int:
    return int(hashlib.sha256(str(sample_id).encode()).hexdigest()[:12], 16)


def held_out_ids(ids: list[str], fraction: float) -> set[str]:
    """Held-out sample ids: the ``ceil(fraction * n)`` ids with the smallest hash (stable as the data
    grows, never empty when fraction > 0, never all of them)."""
    if fraction <= 0 or not ids:
        return set()
    n_eval = min(len(ids) - 1, max(1, math.ceil(fraction * len(ids))))
    return set(sorted(ids, key=_hash)[:n_eval])


def store_part_ids(store: str) -> dict[str, list[str]]:
    """Each part file's sample ids, in read order (reads only that column)."""
    return {f: pq.read_table(f, columns=["sample_id"]).column(0).to_pylist() for f in part_files(store)}


def store_sample_ids(store: str) -> list[str]:
    """The sample ids of a feature store's rows, in read order."""
    return [sid for ids in store_part_ids(store).values() for sid in ids]


def eval_split(store: str, fraction: float) -> set[str]:
    """``held_out_ids`` of a feature store's rows."""
    return held_out_ids(store_sample_ids(store), fraction)


def heldout_parts(part_ids: dict[str, list[str]], eval_ids: set[str]) -> tuple[list[str], list[str]]:
    """(the parts holding held-out rows, the parts holding training rows), each in read order; a mixed
    part is in both."""
    held = [f for f, ids in part_ids.items() if any(i in eval_ids for i in ids)]
    train = [f for f, ids in part_ids.items() if any(i not in eval_ids for i in ids)]
    return held, train
