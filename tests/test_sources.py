"""pipeline.sources: reading conversation sources, cleaning, selection, templating and loss masks."""

import json

import numpy as np
import pytest

from pipeline.config import DataSection
from pipeline.sources import Conversation, Ledger, SkipSample, build_sample, load_conversations
from pipeline.targets import tiny_tokenizer

TWO_TURNS = ({"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
             {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": " It is 4.\nBye "})


def sharegpt(*turns):
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


def write_jsonl(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def masked_runs(tokenizer, sample):
    """The decoded text of each run of consecutive mask=1 tokens."""
    edges = np.flatnonzero(np.diff(np.r_[0, sample.loss_mask, 0]))  # run starts and ends, interleaved
    return [tokenizer.decode(sample.input_ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]


def assert_mask_is_replies(tokenizer, messages, end_token):
    """Masked tokens decode to exactly the assistant replies, each followed by the end-of-turn token."""
    sample = build_sample(Conversation("x", messages, "test"), tokenizer, 4096, {tokenizer.convert_tokens_to_ids(end_token)})
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
    assert ledger.entries[0]["reason"] == "malformed" and ledger.entries[0]["where"] == f"{path}:26"  # where record 3 starts


def test_bad_jsonl_lines_go_to_the_ledger_with_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        sharegpt(("human", "hi"), ("gpt", "hello")),
        '{"conversations": [{"from": "human", "value": "unterminated',
        sharegpt(("human", "only a question")),
        {"messages": [{"role": "user", "content": "openai format"}, {"role": "assistant", "content": "ok"}]},
        [1, 2, 3],
    ])
    ledger = Ledger()
    got = load_conversations(DataSection(source=str(path), shuffle_seed=None), ledger)
    assert [c.where for c in got] == [f"{path}:1", f"{path}:4"]
    assert [(e["reason"], e["where"]) for e in ledger.entries] == [
        ("malformed", f"{path}:2"), ("no_assistant_turn", f"{path}:3"), ("malformed", f"{path}:5")]


def test_missing_source_names_the_file_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.source '.*nowhere.jsonl': no such file; use 'sharegpt'"):
        load_conversations(DataSection(source=str(tmp_path / "nowhere.jsonl")), Ledger())


def test_cleaning_rules(tmp_path):
    """Leading assistant turns and a trailing user turn are dropped; bad orders and empties are skipped."""
    path = write_jsonl(tmp_path / "c.jsonl", [
        sharegpt(("gpt", "leading"), ("human", "q"), ("gpt", "a"), ("human", "trailing")),
        sharegpt(("human", "q"), ("human", "q again"), ("gpt", "a")),
        sharegpt(("human", " "), ("gpt", "")),
        sharegpt(("human", "q"), ("gpt", "a")),  # repeated on the next line: a duplicate
        sharegpt(("human", "q"), ("gpt", "a")),
    ])
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


@pytest.mark.slow
@pytest.mark.parametrize("asset", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_mask_real_templates(asset):
    """SmolLM2's and Qwen2.5's own templates (default system prompts included): exactly the replies."""
    from transformers import AutoTokenizer

    from griffin.assets import prepare_asset

    tokenizer = AutoTokenizer.from_pretrained(prepare_asset(asset))
    assert_mask_is_replies(tokenizer, TWO_TURNS, "<|im_end|>")
    assert_mask_is_replies(tokenizer, ({"role": "system", "content": "Be brief."}, *TWO_TURNS[:2]), "<|im_end|>")


@pytest.mark.slow
def test_assets_command_prints_where_the_target_is(capsys):
    """`griffin assets` on a prepared asset: a cache hit that names the directory."""
    from pipeline.cli import main

    assert main(["assets", "-c", "jobs/configs/tiny.yaml", "target.name=smollm2-135m-instruct", "target.tiny=null"]) == 0
    assert "targets/smollm2-135m-instruct" in capsys.readouterr().out
