"""Run configs: `extends:` chains, one decoding tree, and the CLI's split of overrides and stage flags."""

from pathlib import Path

import pytest

from griffin.config import TreeConfig
from pipeline.cli import split_extra
from pipeline.config import load_config, merge


def test_merge_maps_key_by_key_and_replaces_lists():
    base = {"train": {"batch_tokens": 2048, "schedule": [1, 2]}, "data": {"limit": 5}}
    assert merge(base, {"train": {"schedule": [3]}, "run_name": "x"}) == {
        "train": {"batch_tokens": 2048, "schedule": [3]},
        "data": {"limit": 5},
        "run_name": "x",
    }


def test_extends_chain_and_overrides_apply_last(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "output_dir: out\ntarget: {name: tiny-llama, dtype: float32}\n"
        "decode: {tree: {total_tokens: 8, depth: 3, top_k: 3}}\n"
    )
    (tmp_path / "mid.yaml").write_text("extends: base.yaml\nrun_name: mid\ntrain: {batch_tokens: 512}\n")
    (tmp_path / "top.yaml").write_text("extends: mid.yaml\nrun_name: top\n")
    cfg = load_config(tmp_path / "top.yaml", ["train.batch_tokens=256"])
    assert (cfg.run_name, cfg.target.name, cfg.train.batch_tokens) == ("top", "tiny-llama", 256)
    assert cfg.eval_tree == cfg.decode.tree == TreeConfig(total_tokens=8, depth=3, top_k=3)
    explicit = load_config(tmp_path / "top.yaml", ["eval.tree={total_tokens: 4, depth: 2, top_k: 2}"])
    assert explicit.eval_tree.total_tokens == 4 and explicit.decode.tree.total_tokens == 8


def test_extends_errors_name_the_problem(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ValueError, match="extends itself"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: missing.yaml\n")
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_config(tmp_path / "c.yaml")


def test_the_tree_has_one_home():
    """serve has no tree of its own; eval.tree overrides only the fields it sets."""
    with pytest.raises(ValueError, match="unknown key 'serve.tree'"):
        load_config("jobs/configs/tiny.yaml", ["serve.tree.depth=3"])
    cfg = load_config("jobs/configs/tiny.yaml", ["eval.tree.total_tokens=6"])
    assert cfg.eval_tree == cfg.decode.tree.model_copy(update={"total_tokens": 6})


def test_a_method_key_one_level_too_high_names_its_home():
    """The loss options live in train.method; train.token_loss says so instead of only refusing."""
    with pytest.raises(ValueError, match=r"unknown key 'train.token_loss'.*did you mean 'train.method.token_loss'"):
        load_config("jobs/configs/tiny.yaml", ["train.token_loss=lk_hybrid"])
    cfg = load_config(
        "jobs/configs/tiny.yaml",
        ["train.method.token_loss=lk_hybrid", "train.method.ttt_backprop=full", "draft.vocab_from=reply"],
    )
    assert (cfg.train.method.token_loss, cfg.train.method.ttt_backprop, cfg.draft.vocab_from) == (
        "lk_hybrid",
        "full",
        "reply",
    )
    with pytest.raises(ValueError, match="unknown key 'train.bogus'") as error:
        load_config("jobs/configs/tiny.yaml", ["train.bogus=1"])
    assert "did you mean" not in str(error.value)


def test_split_extra_keeps_stage_flags_with_their_values():
    assert split_extra(["a.b=1", "--stage", "2", "--promote", "c=2"]) == (
        ["a.b=1", "c=2"],
        ["--stage", "2", "--promote"],
    )
    assert split_extra(["stray"]) == (["stray"], [])  # not an override: load_config names it


@pytest.mark.parametrize("uri", ["s3://bucket/runs", "gs://bucket/runs", "file:///mnt/shared/runs"])
def test_a_uri_output_dir_is_refused_not_made_local(uri):
    """Path("s3://b/x") is <cwd>/s3:/b/x: checkpoints would sit on each node's own disk."""
    with pytest.raises(ValueError, match=f"output_dir: must be a path on a filesystem every node mounts .*{uri}"):
        load_config("jobs/configs/tiny.yaml", [f"output_dir={uri}"])
    with pytest.raises(ValueError, match="regenerate.output: must be a path on a filesystem every node mounts"):
        load_config("jobs/configs/tiny.yaml", [f"regenerate.output={uri}/regenerated"])


def test_the_feature_store_may_be_an_object_store():
    """The store is read and written through pyarrow's filesystems (pipeline.data.store._fs): kept as given."""
    cfg = load_config("jobs/configs/tiny.yaml", ["features.store=s3://bucket/features"])
    assert cfg.store_path == "s3://bucket/features" and Path(cfg.output_dir).is_absolute()


def test_the_speculation_policy_drafts_decode_tree_below_its_smallest_batch():
    """The CPU configs' policy {3: null} keeps batch 1-2 on decode.tree (an override of it included) and
    decodes plainly from 3 rows; a policy key below 1 is refused by name."""
    cfg = load_config("jobs/configs/smollm2-quick.yaml", ["decode.tree.total_tokens=8"])
    policy = cfg.speculation_policy
    assert policy.tree_for(1) == policy.tree_for(2) == cfg.decode.tree
    assert cfg.decode.tree.total_tokens == 8
    assert policy.tree_for(3) is None and policy.tree_for(16) is None
    assert load_config("jobs/configs/tiny.yaml").speculation_policy.tree_for(8) is not None  # no policy
    with pytest.raises(ValueError, match="batch sizes"):
        load_config("jobs/configs/tiny.yaml", ["decode.policy={0: null}"])
