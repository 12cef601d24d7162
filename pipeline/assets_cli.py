"""``griffin assets``: prepare the run's target (PyPI asset -> safetensors cache) and say where it is."""

from __future__ import annotations

import time
from typing import Any

from griffin.assets import ASSETS, default_cache_dir, prepare_asset, resolve_target_path
from pipeline.config import RunConfig


def run_assets(cfg: RunConfig) -> dict[str, Any]:
    """Build (once) or find the target named by ``cfg.target.name``; a tiny target needs nothing."""
    name = cfg.target.name
    if cfg.target.tiny is not None:
        return {"target": name, "kind": "tiny (random, built in memory)", "path": None}
    start = time.perf_counter()
    if name in ASSETS:
        path, kind = str(prepare_asset(name)), f"asset (cache {default_cache_dir()})"
    else:
        path, kind = resolve_target_path(name), "local directory or HF hub id"
    print(f"target {name}: {path}")
    return {"target": name, "kind": kind, "path": path, "seconds": round(time.perf_counter() - start, 2)}
