"""``target.revision`` and ``data.revision``: validated by the config, passed to the hub loaders, refused
where they cannot apply, and recorded in lineage without invalidating stores made before them.

The hub is not reachable here, so the pass-through test builds what ``huggingface_hub`` keeps on disk for
a repository with two revisions (refs -> snapshots) and loads it offline: transformers resolves the
revision exactly as it would after a download."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from griffin.target import TargetAdapter
from pipeline.config import load_config
from pipeline.data.regenerate import capture_key
from pipeline.data.sources import Ledger, iter_records
from pipeline.data.store import check_capture_key, key_mismatches
from pipeline.registry.register import lineage_tags
from pipeline.resources import drafts, identity, targets

TINY = "jobs/configs/tiny.yaml"


def test_config_accepts_and_validates_revisions():
    cfg = load_config(TINY, ["target.revision=0123abcd", "data.revision=v1.2"])
    assert cfg.target.revision == "0123abcd" and cfg.data.revision == "v1.2"
    assert load_config(TINY).target.revision is None and load_config(TINY).data.revision is None
    with pytest.raises(ValueError, match="target.revision"):
        load_config(TINY, ["target.revision='not a revision'"])
    # the regenerated set is a local directory: the revision pinned its prompts (prompt_data), not it
    regen = load_config(TINY, ["data.source=regenerated", "regenerate.source=org/prompts", "data.revision=abc"])
    assert regen.prompt_data.revision == "abc" and regen.training_data.revision is None
    assert capture_key(regen, {})["source_revision"] == "abc"  # a resume at another revision is refused
    assert "source_revision" not in capture_key(load_config(TINY), {})  # older regenerated sets keep their key


def test_revision_is_refused_where_no_hub_id_is_loaded(tmp_path):
    cfg = load_config(TINY)
    with pytest.raises(ValueError, match="tiny target"):
        targets.load_target(cfg.target.model_copy(update={"revision": "main"}))
    local = tmp_path / "model"
    targets.load_target(cfg.target).model.save_pretrained(local)
    with pytest.raises(ValueError, match="local directory"):
        TargetAdapter.from_pretrained(local, dtype="float32", revision="main")
    with pytest.raises(ValueError, match="PyPI-packaged asset"):
        TargetAdapter.from_pretrained("smollm2-135m-instruct", revision="main")
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    for source in (str(data), "sharegpt", str(tmp_path)):
        with pytest.raises(ValueError, match="data.revision"):
            next(iter_records(source, Ledger(), revision="v1"))


def _offline_hub_repo(cache: Path, repo: str, revisions: dict[str, TargetAdapter]) -> None:
    """The hub cache layout: models--org--name/{refs/<revision> -> commit, snapshots/<commit>/files}."""
    root = cache / f"models--{repo.replace('/', '--')}"
    for i, (revision, target) in enumerate(revisions.items()):
        commit = f"{i + 1:040x}"
        target.model.save_pretrained(root / "snapshots" / commit)
        target.tokenizer.save_pretrained(root / "snapshots" / commit)
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / revision).write_text(commit)


def test_target_revision_reaches_from_pretrained_and_lineage(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    cfg = load_config(TINY)
    main = targets.build_tiny_target(cfg.target.tiny, torch.float32, seed=0)
    v1 = targets.build_tiny_target(cfg.target.tiny, torch.float32, seed=1)
    _offline_hub_repo(tmp_path / "hub", "test-org/tiny", {"main": main, "v1": v1})
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    section = cfg.target.model_copy(update={"tiny": None, "name": "test-org/tiny", "dtype": "float32"})

    loaded = targets.load_target(section.model_copy(update={"revision": "v1"}))
    assert loaded.weights_sha256 == v1.weights_sha256 != main.weights_sha256  # v1's weights, not main's
    assert targets.load_target(section).weights_sha256 == main.weights_sha256
    fingerprint = identity.target_fingerprint(loaded)
    assert fingerprint["target_revision"] == "v1" and "target_revision" not in identity.target_fingerprint(main)

    # a store captured before revisions were recorded still matches: the revision is lineage, not key
    before = {k: v for k, v in fingerprint.items() if k != "target_revision"}
    assert key_mismatches(before, fingerprint) == []
    store = tmp_path / "store"
    store.mkdir()
    (store / "_manifest.json").write_text(json.dumps({"complete": True, "capture_key": before, "files": []}))
    check_capture_key(str(store), fingerprint)

    # ... and reaches the draft's provenance and the registry's model-version tags
    from griffin.config import DraftConfig
    from griffin.model import GriffinDraft

    draft = GriffinDraft(DraftConfig.from_target(loaded.hf_config), loaded.embed_weight, loaded.lm_head.weight)
    resolved = {"data": {"revision": "2024-06"}}
    path = drafts.save_draft_with_lineage(draft, tmp_path / "draft", loaded, {"resolved_config": resolved})
    tags = lineage_tags(Path(path), "sha")
    assert tags["target.target_revision"] == "v1" and tags["data.revision"] == "2024-06"
