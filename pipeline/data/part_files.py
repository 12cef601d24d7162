"""Where the files of a feature store (or regenerated set) live and what its parts are called
(docs/design.md §5): pyarrow filesystems for local paths and URIs, and part names that come from a
part's plan index and content, so that a retried part rewrites its own file and name order is plan
order; and the parts as a Ray Dataset (``parts_dataset``)."""

from __future__ import annotations

import datetime
import hashlib
import os
import re
from typing import Any, Iterable

import pyarrow.fs as pafs

PART_NAME = re.compile(r"^part-(\d+)-[0-9a-f]{16}\.parquet$")  # part_name's; older stores: part-<actor>-<seq>


def location_fs(location: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and path for a local path or a URI (file://, s3://, gs://...)."""
    uri = location if "://" in location else os.path.abspath(os.path.expanduser(location))
    return pafs.FileSystem.from_uri(uri)


def join(store: str, name: str) -> str:
    return f"{store.rstrip('/')}/{name}" if "://" in store else os.path.join(os.path.abspath(store), name)


def file_sha256(fs: pafs.FileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open_input_stream(path) as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def content_name(prefix: str, sample_ids: Iterable[str]) -> str:
    """``<prefix>-<16 hex of the sha256 of the sorted sample ids>.parquet``."""
    digest = hashlib.sha256("\n".join(sorted(sample_ids)).encode()).hexdigest()[:16]
    return f"{prefix}-{digest}.parquet"


def part_name(index: int, sample_ids: Iterable[str]) -> str:
    """A planned part's file name, from what it holds: a retry of the part (Ray Data reruns a task
    whose actor died) rewrites the same file instead of adding a copy of its rows. The zero-padded
    plan index first keeps name order = plan order (``part_order``); the store's capture key covers
    everything else a row depends on, so the sample ids are the part's content key."""
    return content_name(f"part-{index:06d}", sample_ids)


def part_index(name: str) -> int | None:
    found = PART_NAME.match(name)
    return int(found[1]) if found else None


def part_order(name: str) -> tuple[int, str]:
    """Read order: parts named before content names existed first (by name, their old order), then
    by plan index, compared as numbers (so past a million parts too)."""
    index = part_index(name)
    return (-1 if index is None else index, name)


def next_index(files: list[dict[str, Any]]) -> int:
    """The first plan index of a run into a store holding the parts ``files``: past every part
    already there, so a resumed run's parts never take an existing name and are read after them."""
    return 1 + max((i for f in files if (i := part_index(f["file"])) is not None), default=-1)


def read_parts(batch: Any, columns: list[str] | None) -> Any:
    """``columns`` (None: all) of the part files named in ``batch`` (an Arrow table with a ``file``
    column), in that order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa.concat_tables([pq.read_table(f, columns=columns) for f in batch["file"].to_pylist()])


def parts_dataset(files: list[str], columns: list[str] | None = None) -> Any:
    """The part ``files`` as a Ray Dataset, a read task per part, in order. Not ``ray.data.read_parquet``:
    every execution of it (a training split runs one per epoch) first lists the files through a pool
    of footer-reading actors (32 in Ray 2.60), whose start-up took 10-15 s an execution on a 2-core
    machine, to find files that the manifest already names."""
    import ray

    names = ray.data.from_items([{"file": f} for f in files], override_num_blocks=len(files))
    return names.map_batches(read_parts, batch_size=1, batch_format="pyarrow", fn_kwargs={"columns": columns})
