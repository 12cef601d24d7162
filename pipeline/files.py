"""Files the pipeline writes and finds: the one atomic write (``griffin.checkpoint.atomic_write``, re-exported
here: write a temporary file beside the target, then rename it in one step), the one reuse key (a finished
result is reused only when the key it was written with matches: ``reuse_key``, ``finished``) and files
shipped inside the installed package (``packaged_file``)."""

from __future__ import annotations

import hashlib
import json
from importlib import resources as package_files
from pathlib import Path
from typing import Any

from griffin.checkpoint import atomic_write, atomic_write_json, atomic_write_text

__all__ = [
    "atomic_write",
    "atomic_write_json",
    "atomic_write_text",
    "finished",
    "packaged_file",
    "read_marker",
    "reuse_key",
]


def packaged_file(package: str, *parts: str) -> Path:
    """A data file shipped inside an installed package: ``packaged_file("pipeline.resources", "question_sets",
    "mt_bench.jsonl")``. Callers check that it exists (a broken install leaves it out)."""
    found = package_files.files(package)
    for part in parts:
        found = found / part
    return Path(str(found))


def reuse_key(identity: Any) -> str:
    """The key of a result: the sha256 of everything it depends on (``identity``) as canonical JSON."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def read_marker(path: str | Path) -> dict[str, Any] | None:
    """The JSON object a completion marker at ``path`` holds, or None: no marker, or one that is not a
    whole JSON object (cut short by a kill or a full disk before writes were atomic, or damaged since),
    which marks nothing done, so the stage runs again instead of every rerun skipping it and crashing."""
    try:
        data = json.loads(Path(path).read_text())
    except (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def finished(path: str | Path, key: str) -> dict[str, Any] | None:
    """The finished result written at ``path`` when it records this ``key``, else None (none, another key,
    or a file a kill cut short)."""
    data = read_marker(path)
    return data if data is not None and data.get("key") == key else None
