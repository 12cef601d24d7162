"""pipeline.data.regenerate on a real local Ray with the tiny target: the target's own answers (equal to
unbatched greedy generation), every user turn in order with the target's earlier answers as
history, resume after a kill with every conversation exactly once, refusal of a set made
differently, and featurize reading ``data.source: regenerated``."""

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from pipeline.data import store as st
from pipeline.config import load_config
from pipeline.data.featurize import run_featurize
from pipeline.data.chat import render_chat
from pipeline.data.regenerate import FAULT_ENV, Regenerator, run_regenerate
from pipeline.data.sources import Ledger, load_conversations

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()


def conversation(i):
    turns = [("human", " ".join(WORDS[: 2 + i % 7]) + "?"), ("gpt", "an answer the target would not write")]
    turns += [("human", f"and {WORDS[i % 13]}?"), ("gpt", "another")] * (i % 3)
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "conversations.jsonl"
    path.write_text("\n".join(json.dumps(conversation(i)) for i in range(10)) + "\n")
    return path


def config(root, data, *overrides):
    return load_config(
        "jobs/configs/tiny.yaml",
        [
            f"output_dir={root}",
            f"regenerate.source={data}",
            "data.limit=null",
            "data.shuffle_seed=null",
            "data.max_len=256",
            "regenerate.max_new_tokens=12",
            "regenerate.batch_size=4",
            "regenerate.conversations_per_part=3",
            "data.source=regenerated",
            *overrides,
        ],
    )


def read_set(path):
    manifest = json.loads((path / st.MANIFEST).read_text())
    rows = [row for f in manifest["files"] for row in pq.read_table(path / f["file"]).to_pylist()]
    return manifest, rows


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory, data, ray_local):
    """Built the hard way: the actor raises after its first part (a kill), then a rerun resumes."""
    cfg = config(tmp_path_factory.mktemp("regen"), data)
    os.environ[FAULT_ENV] = "1"
    try:
        with pytest.raises(RuntimeError, match="injected failure .* rerun the same command to resume"):
            run_regenerate(cfg)
    finally:
        del os.environ[FAULT_ENV]
    partial = json.loads((Path(cfg.regenerated_path) / st.MANIFEST).read_text())
    written = sorted(Path(cfg.regenerated_path).glob("part-*.parquet"))  # recorded or not: a kill can land between
    assert not partial["complete"] and written
    result = run_regenerate(cfg)
    return cfg, result, len(written)


def test_every_conversation_exactly_once_after_a_kill(regenerated, data):
    cfg, result, parts_before = regenerated
    manifest, rows = read_set(Path(cfg.regenerated_path))
    assert manifest["complete"] and result["complete"]
    assert len(manifest["files"]) > parts_before  # the rerun added parts, it did not start over
    originals = load_conversations(cfg.prompt_data, Ledger())
    assert sorted(r["sample_id"] for r in rows) == sorted(c.sample_id for c in originals)
    assert manifest["capture_key"]["temperature"] == 0.0 and manifest["capture_key"]["source"] == str(data)
    assert manifest["kind"] == "regenerated"
    assert run_regenerate(cfg)["new_rows"] == 0  # a finished set: nothing to do


def test_answers_are_the_targets_own_greedy_replies_to_its_own_history(regenerated):
    cfg, _, _ = regenerated
    _, rows = read_set(Path(cfg.regenerated_path))
    originals = {c.sample_id: c.messages for c in load_conversations(cfg.prompt_data, Ledger())}
    regenerator = Regenerator(
        cfg.target.model_dump(),
        {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 12, "batch_size": 1, "max_len": 256},
    )
    tokenizer = regenerator.target.tokenizer
    multi_turn = 0
    for row in rows:
        messages = json.loads(row["messages"])
        users = [m["content"] for m in messages if m["role"] == "user"]
        assert users == [m["content"] for m in originals[row["sample_id"]] if m["role"] == "user"][: len(users)]
        multi_turn += len(users) > 1
        for turn in range(len(users)):  # each answer: unbatched greedy from the regenerated history
            history = messages[: 2 * turn + 1]
            ids = torch.tensor([render_chat(tokenizer, history)])
            out = regenerator.target.model.generate(
                input_ids=ids,
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=regenerator.stop_ids,
                pad_token_id=regenerator.pad_id,
            )[0, ids.shape[1] :].tolist()
            stops = [i for i, t in enumerate(out) if t in regenerator.stop_ids]
            expected = tokenizer.decode(out[: stops[0]] if stops else out, skip_special_tokens=True)
            assert messages[2 * turn + 1] == {"role": "assistant", "content": expected}
    assert multi_turn  # later turns were answered with the target's earlier answers as history


def test_featurize_reads_the_regenerated_set(regenerated, tmp_path):
    cfg, _, _ = regenerated
    features = load_config(
        "jobs/configs/tiny.yaml",
        [
            f"output_dir={cfg.output_dir}",
            "data.source=regenerated",
            "data.limit=null",
            "data.max_len=256",
            f"features.store={tmp_path / 'store'}",
        ],
    )
    result = run_featurize(features)
    assert result["complete"] and result["rows"] == len(read_set(Path(cfg.regenerated_path))[1])
    # the store keeps the original conversations' ids: its held-out split is the same conversations
    stored = {
        sid
        for f in st.part_files(str(tmp_path / "store"))
        for sid in pq.read_table(f, columns=["sample_id"]).column(0).to_pylist()
    }
    assert stored == {row["sample_id"] for row in read_set(Path(cfg.regenerated_path))[1]}


def test_a_set_made_differently_is_refused(regenerated, data):
    cfg, _, _ = regenerated
    other = config(cfg.output_dir, data, "regenerate.temperature=0.8")
    with pytest.raises(ValueError, match="made differently.*temperature"):
        run_regenerate(other)


def test_an_unfinished_set_is_not_trained_on(tmp_path, data):
    cfg = config(tmp_path, data)
    path = Path(cfg.regenerated_path)
    st.write_manifest(str(path), {"kind": "regenerated", "complete": False, "files": [], "skipped": []})
    with pytest.raises(ValueError, match="incomplete .* rerun `griffin regenerate"):
        load_conversations(cfg.training_data, Ledger())


def test_regenerate_source_cannot_be_itself():
    with pytest.raises(ValueError, match="regenerate.source must name the original"):
        load_config("jobs/configs/tiny.yaml", ["regenerate.source=regenerated"])
