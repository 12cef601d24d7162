"""pipeline.data.featurize on a real local Ray with the tiny target: features, round trip, resume,
capture-key refusal, --verify, the ledger; and one conversation through the real SmolLM2."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.data import store as st
from pipeline.data.integrity import verify_store
from pipeline.config import load_config
from pipeline.data.featurize import FAULT_ENV, Featurizer, run_featurize
from pipeline.data.part_files import part_index
from pipeline.data.parts import KILL_ENV
from pipeline.data.sources import Conversation, build_sample, clean_messages, record_id
from pipeline.resources.identity import target_fingerprint
from pipeline.resources.targets import load_target
from tests.griffin.test_assets import require_asset

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()


def conversation(i):
    user, reply = " ".join(WORDS[: 2 + i % 7]), " ".join(WORDS[i % 5 : i % 5 + 1 + i % 9])
    turns = [("human", f"{i}: {user}?"), ("gpt", reply)] + [("human", "more"), ("gpt", "ok.")] * (i % 2)
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


@pytest.fixture(scope="module")
def ray_session(ray_local):
    """The suite's one local Ray (conftest): never a stray cluster, started once per session."""
    yield


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """14 good conversations, a malformed line, one with no assistant turn, one too long for max_len."""
    path = tmp_path_factory.mktemp("data") / "conversations.jsonl"
    lines = [json.dumps(conversation(i)) for i in range(14)]
    lines[3:3] = ['{"conversations": [', json.dumps({"messages": [{"role": "user", "content": "alone"}]})]
    lines.append(
        json.dumps({"messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "y"}]})
    )
    path.write_text("\n".join(lines) + "\n")
    return path


def config(root, data, *overrides):
    return load_config(
        "jobs/configs/tiny.yaml",
        [f"output_dir={root}", f"data.source={data}", "data.limit=null", "data.shuffle_seed=null", *overrides],
    )


@pytest.fixture(scope="module")
def featurized(tmp_path_factory, data, ray_session):
    """The module's store, built the hard way: the actor raises after its first part (a kill),
    a half-written temp file is left behind, then a rerun resumes and finishes."""
    cfg = config(tmp_path_factory.mktemp("store"), data)
    os.environ[FAULT_ENV] = "1"
    try:
        with pytest.raises(RuntimeError, match="injected failure .* rerun the same command to resume") as failure:
            run_featurize(cfg)
    finally:
        del os.environ[FAULT_ENV]
    interrupted = {
        "manifest": json.loads((Path(cfg.store_path) / "_manifest.json").read_text()),
        "parts": sorted(p.name for p in Path(cfg.store_path).glob("part-*.parquet")),
        "error": failure.value,
    }
    (Path(cfg.store_path) / ".part-dead-00001.parquet.tmp-0").write_bytes(b"half a file")
    return cfg, run_featurize(cfg), interrupted


def stored_rows(store):
    return {row["sample_id"]: row for row in st.iter_rows(st.part_files(store))}


def test_store_equals_direct_forward(featurized):
    """Every stored row: ids and mask as templated, features == the target's own forward (bf16)."""
    cfg, summary, _ = featurized
    assert (
        summary["complete"] and summary["rows"] == 14 and summary["files"] == 8
    )  # 2 rows a part (14 / 8 actors' share): 13 training rows in 7 parts, the 1 held-out row in its own
    target = load_target(cfg.target)
    rows = stored_rows(cfg.store_path)
    for record in map(conversation, range(14)):
        messages = clean_messages(record, "auto", None)
        sample = build_sample(Conversation("-", messages, "-"), target.tokenizer, 128, set(target.stop_token_ids))
        row = st.decode_row(rows[record_id(record)], target.hidden_size)
        assert row["input_ids"].tolist() == sample.input_ids.tolist()
        assert row["loss_mask"].tolist() == sample.loss_mask.tolist()
        ids = torch.as_tensor(sample.input_ids, dtype=torch.long)[None]
        direct, _ = target.forward(ids, target.new_cache(ids.shape[1]))  # (1, T, D)
        torch.testing.assert_close(row["hidden"], direct[0].bfloat16(), atol=1e-2, rtol=1.6e-2)


def test_ledger_names_bad_records(featurized, data):
    cfg, summary, _ = featurized
    assert summary["skipped"] == {"malformed": 1, "no_assistant_turn": 1, "too_long": 1}
    manifest = st.read_manifest(cfg.store_path)
    assert {(e["reason"], e["where"]) for e in manifest["skipped"]} == {
        ("malformed", f"{data}:4"),
        ("no_assistant_turn", f"{data}:5"),
        ("too_long", f"{data}:17"),
    }
    assert manifest["capture_key"]["layer"] == "last_post_norm" and manifest["capture_key"]["post_norm"] is True
    assert manifest["config"]["data"]["source"] == str(data)


def test_featurizer_without_ray_ignores_padding(featurized):
    """The callable class on a plain dict: a row's features don't depend on its batch mates."""
    cfg, _, _ = featurized
    featurizer = Featurizer(cfg.target.model_dump(), batch_tokens=4096)
    short, long = np.arange(5, 12, dtype=np.int32), np.arange(5, 60, dtype=np.int32)
    batch = {
        "sample_id": np.array(["a", "b"]),
        "input_ids": np.array([short, long], dtype=object),
        "loss_mask": np.array([np.ones(7, np.uint8), np.ones(55, np.uint8)], dtype=object),
    }
    together = featurizer(batch)
    alone = Featurizer(cfg.target.model_dump(), batch_tokens=7)(batch)  # a budget that forces batches of one
    assert together["seq_len"].tolist() == [7, 55] and list(together["error"]) == ["", ""]
    for n, a, b in zip(together["seq_len"], together["hidden"], alone["hidden"]):
        row = {"input_ids": np.zeros(n), "loss_mask": np.zeros(n)}
        torch.testing.assert_close(
            st.decode_row({**row, "hidden": a}, 64)["hidden"],
            st.decode_row({**row, "hidden": b}, 64)["hidden"],
            atol=1e-2,
            rtol=1.6e-2,
        )


def test_ray_dataset_reads_the_store(featurized):
    cfg, summary, _ = featurized
    rows = st.ray_dataset(cfg.store_path).take_all()
    assert sorted(row["sample_id"] for row in rows) == sorted(stored_rows(cfg.store_path))
    direct = stored_rows(cfg.store_path)[rows[0]["sample_id"]]
    assert torch.equal(st.decode_row(rows[0], 64)["hidden"], st.decode_row(direct, 64)["hidden"])


def test_kill_and_resume_gives_every_sample_once(featurized):
    """After the kill the store says incomplete and keeps the finished part; the rerun completes it."""
    cfg, summary, interrupted = featurized
    assert not interrupted["manifest"]["complete"] and len(interrupted["parts"]) == 1
    assert summary["complete"] and summary["new_rows"] < summary["rows"] == 14
    ids = [row["sample_id"] for row in st.iter_rows(st.part_files(cfg.store_path))]
    assert len(ids) == len(set(ids)) == 14
    assert not list(Path(cfg.store_path).glob(".part-*")) and verify_store(cfg.store_path) == []


def test_save_to_disk_source_resumes_the_jsonl_store(featurized, tmp_path):
    """The JSONL's conversations plus one new, as a datasets save_to_disk directory, over a copy of
    the store: same sample ids from either reader, so only the new conversation is featurized."""
    import datasets

    cfg, _, _ = featurized
    source = tmp_path / "saved"
    datasets.Dataset.from_list([conversation(i) for i in range(15)]).save_to_disk(str(source))
    resumed = config(tmp_path, source)
    shutil.copytree(cfg.store_path, resumed.store_path)
    summary = run_featurize(resumed)
    assert summary["complete"] and summary["rows"] == 15 and summary["new_rows"] == 1 and summary["skipped"] == {}
    assert set(stored_rows(resumed.store_path)) == {record_id(conversation(i)) for i in range(15)}


def test_other_capture_key_is_refused(featurized, data):
    cfg, _, _ = featurized
    other = load_target(config("x", data, "target.tiny.hidden_size=32", "target.tiny.intermediate_size=64").target)
    with pytest.raises(ValueError, match="does not match this target: hidden_size: store has 64, expected 32"):
        st.check_capture_key(cfg.store_path, target_fingerprint(other))
    same_shapes = load_target(config("x", data, "target.tiny.num_hidden_layers=1").target)  # other weights
    with pytest.raises(ValueError, match="does not match this target: target_weights_sha256: store has"):
        st.check_capture_key(cfg.store_path, target_fingerprint(same_shapes))
    with pytest.raises(ValueError, match="max_len: store has 128, expected 64"):
        st.check_capture_key(cfg.store_path, target_fingerprint(load_target(cfg.target)), max_len=64)
    with pytest.raises(ValueError, match="captured differently .*dtype: store has 'bf16', expected 'fp8'"):
        run_featurize(config(cfg.output_dir, data, "features.dtype=fp8"))


def test_verify_flags_a_corrupted_file(featurized, tmp_path, capsys):
    from pipeline.cli import main

    cfg, _, _ = featurized
    store = tmp_path / "copy"
    shutil.copytree(cfg.store_path, store)
    assert main(["featurize", "-c", "jobs/configs/tiny.yaml", "--verify", str(store)]) == 0
    victim = sorted(store.glob("part-*.parquet"))[1]
    with victim.open("r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02")
    assert main(["featurize", "-c", "jobs/configs/tiny.yaml", "--verify", str(store)]) == 2
    assert f"{victim.name}: sha256 is" in capsys.readouterr().err


def test_an_actor_killed_after_renaming_its_part_leaves_every_sample_once(data, tmp_path, monkeypatch, ray_session):
    """The actor process is SIGKILLed right after its first part is renamed into place, before the driver
    has the result: Ray Data restarts it and retries the part, which rewrites the same file (a part's
    name is its plan index and content), so the store and its manifest hold every sample once, and
    a fresh store's parts read in plan order."""
    cfg = config(tmp_path, data)
    flag = tmp_path / "killed"
    monkeypatch.setenv(KILL_ENV, str(flag))
    summary = run_featurize(cfg)
    assert flag.exists()  # the kill came after this flag was made: an actor died with a part in place
    names = sorted(p.name for p in Path(cfg.store_path).glob("part-*.parquet"))
    manifest = st.read_manifest(cfg.store_path)
    assert summary["complete"] and names == sorted(f["file"] for f in manifest["files"])
    assert [part_index(n) for n in names] == list(range(8))  # one file per planned part, in plan order
    ids = [row["sample_id"] for row in st.iter_rows(st.part_files(cfg.store_path))]
    assert len(ids) == len(set(ids)) == 14 and manifest["totals"]["rows"] == 14
    assert verify_store(cfg.store_path) == []
    monkeypatch.delenv(KILL_ENV)
    rerun = run_featurize(cfg)
    assert rerun["new_rows"] == 0 and rerun["rows"] == 14 and rerun["files"] == 8


def test_a_repeated_part_is_refused_by_training_and_repaired(featurized, data, tmp_path, capsys):
    """A part twice (the retry of a store written before content names, recorded by a rerun): training
    refuses the store naming the repair, ``--verify --repair`` keeps one copy, training accepts it; and
    such a copy left unrecorded is dropped by a rerun instead of adopted."""
    from pipeline.cli import main
    from pipeline.train.driver import run_train

    cfg, _, _ = featurized
    copy = config(tmp_path, data, "train.schedule=[]")
    shutil.copytree(cfg.store_path, copy.store_path)
    store = Path(copy.store_path)
    first = st.part_files(copy.store_path)[0]
    shutil.copy(first, store / "part-0a1b2c3d-00000.parquet")  # named as before content names: read first
    manifest = st.read_manifest(copy.store_path)
    original = next(f for f in manifest["files"] if first.endswith(f["file"]))
    manifest["files"].append({**original, "file": "part-0a1b2c3d-00000.parquet"})
    st.write_manifest(copy.store_path, manifest)
    with pytest.raises(ValueError, match=r"more than one row .* training would read them twice.* --repair"):
        run_train(copy)
    assert main(["featurize", "-c", "jobs/configs/tiny.yaml", "--verify", str(store)]) == 2
    assert "repeated rows" in capsys.readouterr().err
    assert main(["featurize", "-c", "jobs/configs/tiny.yaml", "--verify", str(store), "--repair"]) == 0
    assert len(list(store.glob("part-*.parquet"))) == 8 and verify_store(str(store)) == []
    assert run_train(copy)["stages"] == []  # the store passes training's checks
    orphan = store / "part-0a1b2c3e-00000.parquet"  # the same rows again, never recorded: a rerun finds it
    shutil.copy(st.part_files(copy.store_path)[0], orphan)
    summary = run_featurize(copy)
    assert summary["new_rows"] == 0 and summary["rows"] == 14 and summary["files"] == 8 and not orphan.exists()


@pytest.mark.slow
def test_smollm2_features_equal_hidden_states():
    """SmolLM2, one templated two-turn conversation: Featurizer == hidden_states[-1] of a plain forward.
    Skipped, saying why, where SmolLM2's package is neither installed nor installable (no package index)."""
    require_asset("smollm2-135m-instruct")
    cfg = load_config(
        "jobs/configs/tiny.yaml", ["target.name=smollm2-135m-instruct", "target.tiny=null", "target.dtype=bfloat16"]
    )
    featurizer = Featurizer(cfg.target.model_dump())
    target = featurizer.target
    messages = clean_messages(conversation(5), "auto", None)
    sample = build_sample(Conversation("one", messages, "-"), target.tokenizer, 512, set(target.stop_token_ids))
    assert sample.loss_mask.sum() > 0 and not sample.truncated
    out = featurizer(
        {
            "sample_id": np.array(["one"]),
            "input_ids": np.array([sample.input_ids]),
            "loss_mask": np.array([sample.loss_mask]),
        }
    )
    row = {"hidden": out["hidden"][0], "input_ids": sample.input_ids, "loss_mask": sample.loss_mask}
    ids = torch.as_tensor(sample.input_ids, dtype=torch.long)[None]  # (1, T)
    with torch.inference_mode():
        expected = target.model(ids, output_hidden_states=True).hidden_states[-1][0]  # (T, D)
    torch.testing.assert_close(st.decode_row(row, target.hidden_size)["hidden"], expected, atol=0, rtol=0)
