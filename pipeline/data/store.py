"""The Parquet feature store (docs/design.md §5): writing parts and the manifest, checking
capture keys and checksums, and reading rows back for training.

One row per conversation: ``sample_id``, ``input_ids`` list<int32>, ``loss_mask`` list<uint8>,
``seq_len`` int32, ``hidden`` = the post-norm last-layer feature (seq_len, hidden_size) as raw
little-endian bf16 bytes, or fp8-e4m3 bytes plus per-token fp32 ``scales``. A store captured with
feature layers (schema version 2, for EAGLE-3-style drafts) adds ``layers``: those k hidden states,
(seq_len, k, hidden_size) in the same codec, with ``layer_scales`` per (token, layer) for fp8;
version-1 stores have no such column and read as before. Parts are written
under a dot-name and renamed into place as ``part-<plan index>-<content hash>.parquet`` (a retried
part rewrites its own file), ``_manifest.json`` is replaced atomically, only a finished run sets
``complete`` (a killed run never leaves a store that looks done), and each sample id is kept in one
part only (``keep_first_copies``).

Shape legend: T tokens, H hidden size, B batch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.data.part_files import (
    content_name,
    file_sha256,
    join,
    location_fs,
    part_index,
    part_order,
    parts_dataset,
    utc_now,
)

if TYPE_CHECKING:  # torch is imported where it is used: Ray Data's processes that read parts never need it
    import torch

MANIFEST = "_manifest.json"
SCHEMA_VERSION = 2  # 2 added the optional ``layers`` column; version-1 parts read the same
LAYER = "last_post_norm"
LAYER_COLUMNS = ("layers", "layer_scales")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
ACTOR_REASONS = ("non_finite",)  # skips found while featurizing: kept across resumes
_COMPRESSION = {
    "sample_id": "ZSTD",
    "input_ids.list.element": "ZSTD",
    "loss_mask.list.element": "ZSTD",
    "seq_len": "ZSTD",
    "hidden": "NONE",
    "scales.list.element": "NONE",
    "layers": "NONE",
    "layer_scales.list.element": "NONE",
}  # features don't compress
logger = logging.getLogger(__name__)
_FIX = "rerun `griffin featurize -c CONFIG` with the store's config to resume or rebuild it"


# ---- feature codec -------------------------------------------------------------------------
def encode_hidden(hidden: torch.Tensor, dtype: str) -> tuple[bytes, np.ndarray | None]:
    """(T, H) features -> raw bytes (+ per-token fp32 scales for fp8)."""
    import torch

    if dtype == "bf16":
        return hidden.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes(), None
    scales = hidden.float().abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX  # (T,)
    quantized = (hidden.float() / scales[:, None]).to(torch.float8_e4m3fn)  # (T, H)
    return quantized.view(torch.uint8).numpy().tobytes(), scales.numpy().astype(np.float32)


def decode_features(data: Any, scales: Any, hidden_size: int) -> torch.Tensor:
    """Stored feature bytes -> (N, H) bf16: a view on the buffer for bf16 (no copy; read-only:
    don't modify it in place), dequantized for fp8 (``scales`` (N,) fp32)."""
    import torch

    with warnings.catch_warnings():  # Arrow buffers and bytes are read-only; torch warns about that
        warnings.simplefilter("ignore", UserWarning)
        if scales is None:  # numpy reads any buffer (bytes from Ray, pa.Buffer from iter_rows) in place
            bits = torch.from_numpy(np.frombuffer(data, dtype=np.int16))
            return bits.view(torch.bfloat16).view(-1, hidden_size)  # (N, H)
        codes = torch.from_numpy(np.frombuffer(data, dtype=np.uint8)).view(torch.float8_e4m3fn)
        return (codes.view(-1, hidden_size).float() * torch.as_tensor(np.asarray(scales))[:, None]).bfloat16()


def decode_row(row: dict[str, Any], hidden_size: int, layers: bool = False) -> dict[str, torch.Tensor]:
    """A stored row -> tensors: ``hidden`` (T, H) and, with ``layers`` (the row must have them),
    ``layers`` (T, k*H), the k feature layers side by side."""
    import torch

    hidden = decode_features(row["hidden"], row.get("scales"), hidden_size)  # (T, H)
    input_ids = torch.as_tensor(np.asarray(row["input_ids"]), dtype=torch.long)  # (T,)
    loss_mask = torch.as_tensor(np.asarray(row["loss_mask"], dtype=np.uint8))  # (T,)
    assert hidden.shape[0] == input_ids.shape[0] == loss_mask.shape[0], "row with inconsistent lengths"
    out = {"input_ids": input_ids, "loss_mask": loss_mask, "hidden": hidden}
    if layers:
        if row.get("layers") is None:
            raise ValueError("this store row has no feature layers; re-featurize with features.layers set")
        stacked = decode_features(row["layers"], row.get("layer_scales"), hidden_size)  # (T*k, H)
        out["layers"] = stacked.reshape(hidden.shape[0], -1)  # (T, k*H)
    return out


# ---- writing -------------------------------------------------------------------------------
def part_table(rows: dict[str, Any], dtype: str, hidden_size: int, layers: tuple[int, ...] = ()) -> pa.Table:
    """Columns (B,) of sample_id, input_ids, loss_mask, hidden bytes [, scales] [, layers bytes
    [, layer_scales]] -> an Arrow table. ``layers``: the hidden-state indices in the layers column."""
    columns = {
        "sample_id": pa.array(list(rows["sample_id"]), pa.string()),
        "input_ids": pa.array(list(rows["input_ids"]), pa.list_(pa.int32())),
        "loss_mask": pa.array(list(rows["loss_mask"]), pa.list_(pa.uint8())),
        "seq_len": pa.array([len(ids) for ids in rows["input_ids"]], pa.int32()),
        "hidden": pa.array(list(rows["hidden"]), pa.large_binary()),
    }
    if dtype == "fp8":
        columns["scales"] = pa.array(list(rows["scales"]), pa.list_(pa.float32()))
    if layers:
        columns["layers"] = pa.array(list(rows["layers"]), pa.large_binary())
        if dtype == "fp8":
            columns["layer_scales"] = pa.array(list(rows["layer_scales"]), pa.list_(pa.float32()))
    metadata = {
        "griffin.schema_version": str(SCHEMA_VERSION),
        "griffin.dtype": dtype,
        "griffin.hidden_size": str(hidden_size),
        "griffin.layer": LAYER,
        "griffin.feature_layers": ",".join(map(str, layers)),
        "griffin.layout": "hidden: row-major (seq_len, hidden_size), little-endian; bf16 bits, or "
        "float8_e4m3fn bits times the row's per-token fp32 scales; layers: "
        "(seq_len, len(feature_layers), hidden_size) the same way, scales per "
        "(token, layer)",
    }
    return pa.table(columns).replace_schema_metadata(metadata)


def write_part(store: str, name: str, table: pa.Table) -> dict[str, Any]:
    """Write ``table`` as ``<store>/<name>`` under a temporary dot-name, then rename it into
    place; returns the manifest entry (rows, tokens, bytes, sha256)."""
    fs, root = location_fs(store)
    with _staged(fs, root, name) as tmp:
        with fs.open_output_stream(tmp) as sink:
            pq.write_table(
                table,
                sink,
                compression={k: v for k, v in _COMPRESSION.items() if k.split(".")[0] in table.column_names},
                use_dictionary=["sample_id"],
                write_statistics=["sample_id", "seq_len"],
                # a row group a row: a resumed training stream reads only the rows it has not trained on
                # (pipeline.train.inputs.read_part); a row is KBs to MBs of features, its footer entry ~80 B a
                # column (benchmarks/featurize/row_groups.md)
                row_group_size=1,
            )
        return {
            "file": name,
            "rows": table.num_rows,
            "tokens": int(pc.sum(table["seq_len"]).as_py() or 0),
            "bytes": fs.get_file_info(tmp).size,
            "sha256": file_sha256(fs, tmp),
        }


@contextlib.contextmanager
def _staged(fs: pafs.FileSystem, root: str, name: str) -> Iterator[str]:
    """A temporary dot-name beside ``<root>/<name>`` to write, moved into place when the block ends, so
    readers never see half a file. Over pyarrow filesystems (object stores too), where the local
    ``atomic_write`` cannot go; ``open_for_writing`` deletes a killed writer's leftovers."""
    fs.create_dir(root, recursive=True)
    tmp = f"{root}/.{name}.tmp-{uuid.uuid4().hex[:8]}"
    yield tmp
    fs.move(tmp, f"{root}/{name}")


def _index_columns(store: str, name: str) -> pa.Table:
    fs, root = location_fs(store)
    with fs.open_input_file(f"{root}/{name}") as f:
        return pq.read_table(f, columns=["sample_id", "seq_len"])  # skips the feature bytes


def describe_part(store: str, name: str, sha256: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """The manifest entry and sample ids of an existing part, re-read (and re-hashed unless given)."""
    fs, root = location_fs(store)
    table = _index_columns(store, name)
    entry = {
        "file": name,
        "rows": table.num_rows,
        "tokens": int(pc.sum(table["seq_len"]).as_py() or 0),
        "bytes": fs.get_file_info(f"{root}/{name}").size,
        "sha256": sha256 or file_sha256(fs, f"{root}/{name}"),
    }
    return entry, table["sample_id"].to_pylist()


def write_manifest(store: str, manifest: dict[str, Any]) -> None:
    """Recompute the totals and replace ``_manifest.json`` atomically (temp file + rename)."""
    files = manifest["files"]
    tokens, size = sum(f["tokens"] for f in files), sum(f["bytes"] for f in files)
    manifest["totals"] = {
        "files": len(files),
        "rows": sum(f["rows"] for f in files),
        "tokens": tokens,
        "bytes": size,
        "bytes_per_token": size / tokens if tokens else None,
        "skipped": len(manifest["skipped"]),
    }
    manifest["updated"] = utc_now()
    fs, root = location_fs(store)
    with _staged(fs, root, MANIFEST) as tmp, fs.open_output_stream(tmp) as f:
        f.write(json.dumps(manifest, indent=1).encode())


def open_for_writing(
    store: str, capture_key: dict, config: dict, weights_sha256: Callable[[], str] | None = None
) -> tuple[dict[str, Any], set[str]]:
    """The manifest to continue (marked incomplete) and the sample ids already done. Deletes
    half-written temp files, forgets listed parts that are gone, adopts finished parts that a
    killed run wrote but never recorded, and refuses a store captured with another key."""
    fs, root = location_fs(store)
    listing = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    names = sorted(os.path.basename(i.path) for i in listing if i.type == pafs.FileType.File)
    manifest = _read_json(fs, f"{root}/{MANIFEST}") if MANIFEST in names else None
    if manifest is None:
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "created": utc_now(),
            "capture_key": capture_key,
            "files": [],
            "skipped": [],
        }
    elif problems := key_mismatches(manifest["capture_key"], capture_key, weights_sha256):
        raise ValueError(
            f"feature store {store} holds features captured differently ({'; '.join(problems)}); "
            "set features.store to a new location or delete the old store"
        )
    for name in names:
        if name.startswith(".part-") or name.startswith(f".{MANIFEST}.tmp-"):
            fs.delete_file(f"{root}/{name}")  # a killed writer's leftovers, never complete
    names = [n for n in names if not n.startswith(".")]
    recorded = {f["file"]: f for f in manifest["files"] if f["file"] in names}  # a file listed twice: once
    # renamed into place but never recorded (the driver never got the result): adopted, unless it repeats
    # rows of a part kept before it (a retry under an older naming scheme, a part of another plan)
    orphans = [
        describe_part(store, n)[0]
        for n in names
        if n not in recorded and n.startswith("part-") and n.endswith(".parquet")
    ]
    seen: set[str] = set()
    files, _ = keep_first_copies(store, list(recorded.values()), seen)  # recorded parts first: an orphan never
    adopted, _ = keep_first_copies(store, orphans, seen)  # displaces a part the manifest already lists
    manifest.update(complete=False, config=config, files=files + adopted)
    return manifest, seen | {s["sample_id"] for s in manifest["skipped"] if s["reason"] in ACTOR_REASONS}


def keep_first_copies(store: str, entries: list[dict], seen: set[str]) -> tuple[list[dict], list[str]]:
    """``entries`` in read order, each sample id kept in the first part holding it (or none, if in
    ``seen``): a part whose rows all appear before is deleted, one with some rewritten without them
    under its new content name. Adds the kept ids to ``seen``; returns the entries kept and a line per
    part changed. Both copies of a row hold the same features (one capture key), so either may go."""
    fs, root = location_fs(store)
    kept, changes = [], []
    for entry in sorted(entries, key=lambda e: part_order(e["file"])):
        ids = _index_columns(store, entry["file"])["sample_id"].to_pylist()
        first = []  # whether each row is its sample's first copy
        for sid in ids:
            first.append(sid not in seen)
            seen.add(sid)
        if all(first):
            kept.append(entry)
            continue
        if any(first):
            with fs.open_input_file(f"{root}/{entry['file']}") as f:
                table = pq.read_table(f).filter(pa.array(first))
            index = part_index(entry["file"])
            prefix = entry["file"].removesuffix(".parquet") if index is None else f"part-{index:06d}"
            kept.append(write_part(store, content_name(prefix, table["sample_id"].to_pylist()), table))
        fs.delete_file(f"{root}/{entry['file']}")
        changes.append(
            f"{entry['file']}: {first.count(False)} of {len(ids)} rows repeat an earlier part; "
            + (f"rewritten as {kept[-1]['file']}" if any(first) else "deleted")
        )
    for line in changes:
        logger.warning("%s: %s", store, line)
    return kept, changes


# ---- checking ------------------------------------------------------------------------------
def _read_json(fs: pafs.FileSystem, path: str) -> dict[str, Any]:
    with fs.open_input_stream(path) as f:
        return json.loads(f.read())


def read_manifest(store: str, require_complete: bool = True) -> dict[str, Any]:
    fs, root = location_fs(store)
    if fs.get_file_info(f"{root}/{MANIFEST}").type != pafs.FileType.File:
        raise FileNotFoundError(
            f"no feature store at {store} (missing {MANIFEST}); run `griffin featurize -c "
            "CONFIG` first, or point features.store at an existing store"
        )
    manifest = _read_json(fs, f"{root}/{MANIFEST}")
    if require_complete and not manifest.get("complete"):
        raise ValueError(f"feature store {store} is incomplete (an interrupted run); {_FIX}")
    return manifest


def key_mismatches(
    stored: dict[str, Any], expected: dict[str, Any], weights_sha256: Callable[[], str] | None = None
) -> list[str]:
    """How a store's capture key differs from ``expected``, the target's identity compared as
    ``pipeline.resources.identity.fingerprint_problems`` does (``weights_sha256``: the target's
    weights hash, asked for only when the store records no files digest)."""
    from pipeline.resources.identity import fingerprint_problems  # (it imports transformers)

    return fingerprint_problems(stored, expected, weights_sha256 or _no_weights_hash, words=("store has", "expected"))


def _no_weights_hash() -> str:
    raise ValueError(
        "the store records its target by weights hash (made before file digests), and this check was given no "
        "way to compute it: check it with `griffin train` or `griffin featurize`, which do"
    )


def check_capture_key(
    store: str,
    fingerprint: dict[str, Any],
    max_len: int | None = None,
    weights_sha256: Callable[[], str] | None = None,
) -> dict[str, Any]:
    """The store's manifest if it was captured from this target (and ``max_len``); else ValueError."""
    manifest = read_manifest(store)
    expected = {**fingerprint, **({} if max_len is None else {"max_len": max_len})}
    if problems := key_mismatches(manifest["capture_key"], expected, weights_sha256):
        raise ValueError(
            f"feature store {store} does not match this target: {'; '.join(problems)}. Featurize "
            "for this target (`griffin featurize -c CONFIG features.store=NEW`) or train the target "
            "the store was made with"
        )
    return manifest


def part_files(store: str) -> list[str]:
    """The store's parts in read order (``part_order``: plan order for a store featurized in one go)."""
    return [join(store, name) for name in sorted((f["file"] for f in read_manifest(store)["files"]), key=part_order)]


# ---- reading -------------------------------------------------------------------------------
def ray_dataset(store: str):
    """A Ray Dataset of the store's rows (complete stores only), a read task per part."""
    return parts_dataset(part_files(store))


def _lists(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    return column.offsets.to_numpy(), column.values.to_numpy()  # zero-copy views


def _rows(batch: pa.RecordBatch) -> Iterator[dict[str, Any]]:
    """Rows of a record batch as numpy views and Arrow buffers (no copies of the features)."""
    (id_offsets, ids), (mask_offsets, masks) = _lists(batch["input_ids"]), _lists(batch["loss_mask"])
    offsets, data = _binary(batch["hidden"])
    scales = _lists(batch["scales"]) if "scales" in batch.schema.names else None
    layers = _binary(batch["layers"]) if "layers" in batch.schema.names else None
    layer_scales = _lists(batch["layer_scales"]) if "layer_scales" in batch.schema.names else None
    for i, (sample_id, seq_len) in enumerate(zip(batch["sample_id"].to_pylist(), batch["seq_len"].to_numpy())):
        yield {
            "sample_id": sample_id,
            "seq_len": int(seq_len),
            "input_ids": ids[id_offsets[i] : id_offsets[i + 1]],
            "loss_mask": masks[mask_offsets[i] : mask_offsets[i + 1]],
            "hidden": data.slice(int(offsets[i]), int(offsets[i + 1] - offsets[i])),
            "scales": None if scales is None else scales[1][scales[0][i] : scales[0][i + 1]],
            "layers": None
            if layers is None
            else layers[1].slice(int(layers[0][i]), int(layers[0][i + 1] - layers[0][i])),
            "layer_scales": None
            if layer_scales is None
            else layer_scales[1][layer_scales[0][i] : layer_scales[0][i + 1]],
        }


def table_rows(table: pa.Table) -> Iterator[dict[str, Any]]:
    """Rows of an Arrow table (a Ray Data block) as ``_rows`` gives them."""
    for batch in table.combine_chunks().to_batches():
        yield from _rows(batch)


def _binary(column: pa.Array) -> tuple[np.ndarray, pa.Buffer]:
    """A large_binary column's offsets and data buffer (zero-copy)."""
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int64)[column.offset : column.offset + len(column) + 1]
    return offsets, column.buffers()[2]


def iter_rows(files: list[str], layers: bool = False) -> Iterator[dict[str, Any]]:
    """Every row of ``files`` in order, streamed record batch by record batch; the feature-layer
    columns are read only with ``layers`` (they are k times the size of the rest)."""
    for path in files:
        fs, local = location_fs(path)
        with fs.open_input_file(local) as f:
            parquet = pq.ParquetFile(f)
            columns = [c for c in parquet.schema_arrow.names if layers or c not in LAYER_COLUMNS]
            for batch in parquet.iter_batches(batch_size=64, columns=columns):
                yield from _rows(batch)


def _pad(rows: list[dict[str, torch.Tensor]], sample_ids: list[str]) -> dict[str, Any]:
    import torch

    batch, longest, hidden_size = len(rows), max(r["input_ids"].shape[0] for r in rows), rows[0]["hidden"].shape[1]
    out = {
        "input_ids": torch.zeros(batch, longest, dtype=torch.long),  # (B, T)
        "loss_mask": torch.zeros(batch, longest),  # (B, T)
        "attention_mask": torch.zeros(batch, longest, dtype=torch.long),  # (B, T)
        "features": torch.zeros(batch, longest, hidden_size, dtype=torch.bfloat16),  # (B, T, H)
        "sample_ids": sample_ids,
    }
    if "layers" in rows[0]:
        out["layer_features"] = torch.zeros(
            batch, longest, rows[0]["layers"].shape[1], dtype=torch.bfloat16
        )  # (B, T, k*H)
    for b, row in enumerate(rows):
        n = row["input_ids"].shape[0]
        out["input_ids"][b, :n], out["loss_mask"][b, :n] = row["input_ids"], row["loss_mask"]
        out["attention_mask"][b, :n], out["features"][b, :n] = 1, row["hidden"]
        if "layers" in row:
            out["layer_features"][b, :n] = row["layers"]
    return out


def pad_batches(
    rows: Iterable[dict[str, Any]], batch_tokens: int, hidden_size: int, layers: bool = False
) -> Iterator[dict[str, Any]]:
    """Consecutive rows grouped so that B * T_max <= batch_tokens (a longer row goes alone), right-padded;
    with ``layers``, batches also hold ``layer_features`` (B, T, k*H)."""
    group, ids, longest = [], [], 0
    for row in rows:
        n = int(row["seq_len"])
        if group and (len(group) + 1) * max(longest, n) > batch_tokens:
            yield _pad(group, ids)
            group, ids, longest = [], [], 0
        group.append(decode_row(row, hidden_size, layers))
        ids.append(row["sample_id"])
        longest = max(longest, n)
    if group:
        yield _pad(group, ids)
