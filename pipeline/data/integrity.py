"""Checking a feature store against its manifest (docs/design.md §5): ``verify_store`` re-reads every
part (``griffin featurize --verify``), ``repair_store`` keeps each sample id's first copy only
(``--verify --repair``) and ``require_unique_ids`` is training's refusal of a store holding a sample
twice, which names that repair."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa

from pipeline.data.part_files import file_sha256, location_fs, part_order
from pipeline.data.store import MANIFEST, describe_part, keep_first_copies, read_manifest, write_manifest


def repair_command(store: str) -> str:
    return f"griffin featurize -c CONFIG --verify {store} --repair"


def require_unique_ids(store: str, sample_ids: list[str]) -> None:
    """Refuse a store whose rows repeat a sample id: training would read those samples twice (a store
    written before part names were content keys can hold a retried part twice)."""
    repeated = {sid: n for sid, n in Counter(sample_ids).items() if n > 1}
    if repeated:
        example = next(iter(repeated))
        raise ValueError(
            f"feature store {store} holds {len(repeated)} sample ids in more than one row (e.g. {example!r} "
            f"{repeated[example]} times): training would read them twice. Keep one copy of each with "
            f"`{repair_command(store)}`"
        )


def repair_store(store: str) -> list[str]:
    """Drop the repeated copies of every sample (``keep_first_copies``: a part holding only repeats is
    deleted, one holding some is rewritten without them) and rewrite the manifest; returns a line per
    part changed. The store keeps its ``complete``: it holds the same samples as before."""
    manifest = read_manifest(store, require_complete=False)
    try:
        files, changes = keep_first_copies(store, manifest["files"], set())
    except (OSError, pa.ArrowException) as error:
        raise ValueError(
            f"cannot repair {store}: a part is unreadable ({type(error).__name__}: {str(error)[:200]}); "
            "`--verify` names it: delete it and rerun `griffin featurize` with the store's config"
        ) from error
    if changes:
        manifest["files"] = files
        write_manifest(store, manifest)
    return changes


def verify_store(store: str) -> list[str]:
    """Problems found re-reading every part: missing files, sha256 or row/token count mismatches,
    duplicate sample ids, an incomplete manifest. Empty when the store is sound."""
    manifest, problems, seen = read_manifest(store, require_complete=False), [], set()
    if not manifest.get("complete"):
        problems.append(f"{MANIFEST}: incomplete (the run was interrupted)")
    fs, root = location_fs(store)
    for expected in sorted(manifest["files"], key=lambda f: part_order(f["file"])):  # the copy read first is kept
        name = expected["file"]
        try:
            if (sha256 := file_sha256(fs, f"{root}/{name}")) != expected["sha256"]:
                problems.append(
                    f"{name}: sha256 is {sha256}, manifest says {expected['sha256']} (file corrupted or modified)"
                )
                continue
            actual, sample_ids = describe_part(store, name, sha256)
        except (OSError, pa.ArrowException) as error:
            problems.append(f"{name}: unreadable ({type(error).__name__}: {str(error)[:200]})")
            continue
        problems += [
            f"{name}: {k} is {actual[k]}, manifest says {expected[k]}"
            for k in ("rows", "tokens", "bytes")
            if actual[k] != expected[k]
        ]
        if duplicates := seen.intersection(sample_ids):
            problems.append(f"{name}: {len(duplicates)} sample ids also in a part read before it (repeated rows)")
        seen.update(sample_ids)
    return problems
