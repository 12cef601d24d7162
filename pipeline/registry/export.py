"""``griffin export --to griffin-upstream|hf|speculators|specforge``: a draft (any URI, lineage checked) in
another layout, written by ``griffin.export.export_draft``, reloaded and checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from griffin.export import export_draft
from pipeline.config import RunConfig
from pipeline.registry.register import default_checkpoint
from pipeline.resources.drafts import check_lineage, resolve_draft
from pipeline.resources.targets import load_target


def run_export(
    cfg: RunConfig, to: str, source: str | None = None, out: str | None = None, verifier: str | None = None
) -> dict[str, Any]:
    """``griffin export --to griffin-upstream|hf|speculators|specforge``: write, reload and check the export."""
    draft_dir = resolve_draft(source, cfg) if source else default_checkpoint(cfg)
    target = load_target(cfg.target)
    check_lineage(draft_dir, target, source)
    out_dir = export_draft(
        draft_dir, Path(out) if out else cfg.run_dir / "export" / to, layout=to, target=target, verifier=verifier
    )
    return {"layout": to, "out": str(out_dir), "files": sorted(p.name for p in out_dir.iterdir())}
