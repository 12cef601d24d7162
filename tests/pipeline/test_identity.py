"""A target named without loading it (pipeline.resources.identity, griffin.target_files): the driver's
identity of a target read from files, how little it reads, and records made before file digests."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from griffin import target_files
from griffin.checkpoint import tensors_sha256
from griffin.model import GriffinDraft
from griffin.target import TargetAdapter
from pipeline.config import load_config
from pipeline.data import store as st
from pipeline.resources import drafts, identity, targets

TINY = "jobs/configs/tiny.yaml"


@pytest.fixture()
def saved(tmp_path, monkeypatch):
    """The tiny target saved as a local directory (its section reads it from there), with a fresh
    digest cache."""
    monkeypatch.setenv("GRIFFIN_CACHE_DIR", str(tmp_path / "cache"))
    cfg = load_config(TINY)
    tiny = targets.build_tiny_target(cfg.target.tiny, torch.float32)
    tiny.model.save_pretrained(tmp_path / "model")
    tiny.tokenizer.save_pretrained(tmp_path / "model")
    section = cfg.target.model_copy(update={"tiny": None, "name": str(tmp_path / "model"), "dtype": "float32"})
    return section, tiny


def _no_weights_loaded(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the target's weights were loaded")

    monkeypatch.setattr(TargetAdapter, "from_pretrained", refuse)
    monkeypatch.setattr(targets, "load_target", refuse)


def test_the_driver_identity_loads_no_weights_and_matches_the_loaded_target(saved, monkeypatch):
    section, tiny = saved
    loaded = targets.load_target(section)
    expected = identity.target_fingerprint(loaded)
    assert identity.FILES in expected and identity.WEIGHTS not in expected  # a target read from files
    _no_weights_loaded(monkeypatch)
    named = identity.target_identity(section)
    assert identity.target_fingerprint(named) == expected
    assert (named.vocab_size, named.hidden_size) == (loaded.vocab_size, loaded.hidden_size)
    assert named.stop_token_ids == loaded.stop_token_ids
    assert named.embed_weight.is_meta and named.head_weight.is_meta and len(named.backbone.layers) == 2


def test_a_local_file_is_hashed_once_per_machine(saved):
    section, _ = saved
    path = section.name
    weights = Path(path) / "model.safetensors"
    truth = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert target_files.file_sha256(path, "model.safetensors") == truth
    (memo,) = [p for p in target_files.digest_cache().iterdir() if p.read_text() == truth]
    memo.write_text("f" * 64)  # the memo, not the file, answers the next time
    assert target_files.file_sha256(path, "model.safetensors") == "f" * 64
    weights.write_bytes(weights.read_bytes())  # a rewritten file (new mtime) is hashed again
    assert target_files.file_sha256(path, "model.safetensors") == truth


def test_a_hub_target_is_named_by_its_blobs_without_reading_them(saved, tmp_path, monkeypatch):
    """The hub cache stores an LFS file as blobs/<sha256>: the name is the digest. A blob whose bytes
    do not match its name proves nothing read it; a local copy of the same files has the same identity."""
    import huggingface_hub.constants as hub

    section, _ = saved
    local = Path(section.name)
    root = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = root / "snapshots" / ("1" * 40), root / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in local.iterdir():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, blobs / digest)
        (snapshot / file.name).symlink_to(blobs / digest)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("1" * 40)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    assert target_files.files_sha256("org/tiny") == target_files.files_sha256(str(local))

    weights = snapshot / "model.safetensors"
    fake = blobs / ("a" * 64)
    weights.resolve().rename(fake)
    weights.unlink()
    weights.symlink_to(fake)
    assert target_files.file_sha256("org/tiny", "model.safetensors") == "a" * 64


def test_records_made_before_file_digests_are_checked_by_weights(saved, tmp_path, caplog):
    """A store or draft recording only the weights hash (every one made before file digests) still
    fits its target: the driver's identity then loads the target once, and says so; another target's
    record is refused by name either way."""
    section, tiny = saved
    named = identity.target_identity(section)
    old = {k: v for k, v in identity.target_fingerprint(named).items() if k != identity.FILES}
    old[identity.WEIGHTS] = tiny.weights_sha256
    store = tmp_path / "store"
    store.mkdir()
    (store / "_manifest.json").write_text(json.dumps({"complete": True, "capture_key": old, "files": []}))
    with caplog.at_level(logging.WARNING, logger="pipeline.resources.identity"):
        st.check_capture_key(str(store), identity.target_fingerprint(named), None, lambda: named.weights_sha256)
    assert "loading the whole target" in caplog.text and named.weights_sha256 == tensors_sha256(tiny.model.state_dict())

    draft = GriffinDraft.for_target(tiny)
    path = drafts.save_draft_with_lineage(draft, tmp_path / "draft", targets.load_target(section))
    config = json.loads((path / "config.json").read_text())
    assert identity.FILES in config["provenance"]["target"]
    drafts.check_lineage(path, identity.target_identity(section))
    config["provenance"]["target"] = old | {identity.WEIGHTS: "0" * 64}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="target_weights_sha256: recorded 000000000000…"):
        drafts.check_lineage(path, named)
    config["provenance"]["target"][identity.FILES] = "1" * 64
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="target_files_sha256: recorded 111111111111…"):
        drafts.check_lineage(path, named)  # the files digest decides when both have one


def test_the_identity_is_the_model_not_who_wrote_it(saved):
    """The config is compared as the model reads it: another transformers version (or a path, or the
    load dtype) in config.json is the same model, another value is not. Beside an index of shards, the
    one file is what transformers loads, so it is what the identity covers."""
    section, _ = saved
    path = Path(section.name)
    before = target_files.files_sha256(str(path))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "transformers_version": "9.9.9", "dtype": "float16"}))
    assert target_files.files_sha256(str(path)) == before
    (path / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))
    assert target_files.files_sha256(str(path)) != before
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "shard.safetensors"}}))
    assert target_files.weight_file_names(str(path)) == ["model.safetensors"]


def test_promotion_compares_targets_across_fingerprint_kinds():
    from pipeline.registry.register import _other_target

    old = {"target.target_weights_sha256": "a" * 64, "target.tokenizer_sha256": "t", "target.vocab_size": "64"}
    new = {"target.target_files_sha256": "b" * 64, "target.tokenizer_sha256": "t", "target.vocab_size": "64"}
    assert _other_target(new, old) is None  # no common identity: tokenizer, template and sizes agree
    assert "tokenizer_sha256" in _other_target({**new, "target.tokenizer_sha256": "u"}, old)
    assert "target_files_sha256" in _other_target(new, {**new, "target.target_files_sha256": "c" * 64})
