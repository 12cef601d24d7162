"""A target's files and their digests: what names a target without loading it.

``files_sha256(path, revision)`` is the target's identity in every lineage record made since file
fingerprints (``pipeline.resources.identity``): sha256 over its config (parsed, without the fields
that only say which transformers wrote it) and each weight file's own sha256, by file name. Nothing is loaded and, where a digest is already known, nothing is read:

- a hub file stored with Git LFS (every weight file) is named by its sha256: the cached blob's name,
  or the hub's ETag when it is not cached, so a driver never downloads the weights to name them;
- a local file is hashed once per machine, the digest kept under ``<cache>/file-digests`` by path,
  inode, size, modification and change times (an 8B target: ~16 GB read once, then nothing).

A hub file's LFS sha256 is the sha256 of its bytes, so a model copied from the hub into a local
directory has the hub's identity.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Literal, overload

CONFIG = "config.json"
WEIGHT_LAYOUTS = (  # (single file, index), in transformers' order of preference: the one file first
    ("model.safetensors", "model.safetensors.index.json"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
)
VOLATILE_CONFIG = ("transformers_version", "_name_or_path", "torch_dtype", "dtype")  # who wrote it, not the model
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 16 << 20


def is_local(path: str) -> bool:
    return Path(path).expanduser().is_dir()


@overload
def locate(path: str, name: str, revision: str | None = None, optional: Literal[False] = False) -> str: ...
@overload
def locate(path: str, name: str, revision: str | None = None, *, optional: bool) -> str | None: ...
def locate(path: str, name: str, revision: str | None = None, optional: bool = False) -> str | None:
    """The local path of file ``name`` of a local directory or a hub id (downloaded when not cached);
    None when ``optional`` and the target has no such file."""
    if is_local(path):
        found = Path(path).expanduser() / name
        return str(found) if found.is_file() or not optional else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return hf_hub_download(path, name, revision=revision)
    except EntryNotFoundError:  # also the offline "not in the cache"
        if optional:
            return None
        raise


def weight_file_names(path: str, revision: str | None = None) -> list[str]:
    """The files that hold the target's weights: an index's shards, or its one file."""
    for single, index in WEIGHT_LAYOUTS:
        if locate_without_download(path, single, revision) is not None:
            return [single]
        if (found := locate(path, index, revision, optional=True)) is not None:
            return sorted(set(json.loads(Path(found).read_text())["weight_map"].values()))
    raise FileNotFoundError(
        f"target {path} has no weight files ({', '.join(name for pair in WEIGHT_LAYOUTS for name in pair)})"
    )


def locate_without_download(path: str, name: str, revision: str | None = None) -> str | None:
    """Whether the target has file ``name``, without downloading it: its local path (a directory's file
    or a cached hub file), the hub's ETag when the hub has it uncached, or None."""
    if is_local(path):
        return locate(path, name, optional=True)
    cached = _cached(path, name, revision)
    return cached if cached is not None else _hub_etag(path, name, revision)


def file_sha256(path: str, name: str, revision: str | None = None) -> str:
    """The sha256 of the bytes of file ``name`` of the target (module docstring: how little is read)."""
    if not is_local(path):
        cached = _cached(path, name, revision)
        if cached is not None and _SHA256.fullmatch(blob := Path(cached).resolve().name):
            return blob  # an LFS blob is named by its sha256
        if cached is None and _SHA256.fullmatch(etag := _hub_etag(path, name, revision) or ""):
            return etag
    return _content_sha256(Path(locate(path, name, revision)))


def config_sha256(path: str, revision: str | None = None) -> str:
    """sha256 of the target's config as the model reads it: the parsed ``config.json`` without what
    only says who wrote it (``VOLATILE_CONFIG``: the transformers version, a path, the load dtype),
    so one model converted or saved on two machines is one model."""
    config = json.loads(Path(locate(path, CONFIG, revision)).read_text())
    kept = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def files_sha256(path: str, revision: str | None = None) -> str:
    """The target's identity: sha256 over its config's and weight files' digests, by file name."""
    listing = {name: file_sha256(path, name, revision) for name in weight_file_names(path, revision)}
    listing[CONFIG] = config_sha256(path, revision)
    return hashlib.sha256(json.dumps(listing, sort_keys=True).encode()).hexdigest()


def _cached(repo: str, name: str, revision: str | None) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, name, revision=revision)
    return found if isinstance(found, str) else None  # a "known not to exist" marker is not a path


def _hub_etag(repo: str, name: str, revision: str | None) -> str | None:
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        return get_hf_file_metadata(hf_hub_url(repo, name, revision=revision)).etag
    except EntryNotFoundError:
        return None


def digest_cache() -> Path:
    """Where local files' digests are kept: ``<cache>/file-digests``, one small file each."""
    from griffin.assets import default_cache_dir

    return default_cache_dir() / "file-digests"


def _content_sha256(file: Path) -> str:
    """sha256 of a local file's bytes, read once per (path, size, mtime) on this machine."""
    stat = file.stat()  # ctime: a copy that keeps the mtime (rsync -a, cp -p) still gets a new one
    key = f"{file.resolve()}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"
    memo = digest_cache() / hashlib.sha256(key.encode()).hexdigest()
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    try:  # a read-only cache only costs the next run another read
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(digest.hexdigest())
        tmp.replace(memo)
    except OSError:
        pass
    return digest.hexdigest()
