"""Files the pipeline writes and finds: the one atomic write (``griffin.checkpoint.atomic_write``, re-exported
here: write a temporary file beside the target, then rename it in one step) and files shipped inside the
installed package (``packaged_file``)."""

from __future__ import annotations

from importlib import resources as package_files
from pathlib import Path

from griffin.checkpoint import atomic_write, atomic_write_json, atomic_write_text

__all__ = ["atomic_write", "atomic_write_json", "atomic_write_text", "packaged_file"]


def packaged_file(package: str, *parts: str) -> Path:
    """A data file shipped inside an installed package: ``packaged_file("pipeline.resources", "question_sets",
    "mt_bench.jsonl")``. Callers check that it exists (a broken install leaves it out)."""
    found = package_files.files(package)
    for part in parts:
        found = found / part
    return Path(str(found))
