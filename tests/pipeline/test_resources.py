"""The resources layer: shipped question sets, draft resolution and lineage, the outside-the-checkout audit."""

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from griffin.model import GriffinDraft
from griffin.checkpoint import save_draft as save_without_lineage
from pipeline.resources import drafts, questions, targets
from pipeline.config import load_config
from tests.conftest import AUDIT, REPO


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return load_config("jobs/configs/tiny.yaml", [f"output_dir={tmp_path_factory.mktemp('out')}"])


@pytest.fixture(scope="module")
def target(cfg):
    return targets.load_target(cfg.target)


def test_shipped_question_sets_are_the_benchmark_files():
    """MT-Bench: 80 questions of 2 turns; HumanEval: the 80-problem subset, all of it in the 164."""
    mt_bench, subset, full = (questions.load_questions(name) for name in ("mt_bench", "humaneval", "humaneval_164"))
    assert len(mt_bench) == 80 and all(len(q["turns"]) == 2 for q in mt_bench)
    assert [q["question_id"] for q in mt_bench] == list(range(81, 161))
    assert len(subset) == 80 and len(full) == 164
    assert {q["turns"][0] for q in subset} <= {q["turns"][0] for q in full}
    assert all(q["turns"][0].startswith("Complete the code I provided.") for q in full)
    assert len(questions.load_questions("humaneval", 5)) == 5
    assert questions.question_set("mt_bench").is_relative_to(REPO / "pipeline" / "resources" / "question_sets")


def test_question_paths_and_bad_files(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"question_id": 7, "turns": ["Hi?"]}) + "\n")
    assert questions.load_questions(str(path)) == [{"question_id": 7, "turns": ["Hi?"]}]
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        questions.load_questions(str(tmp_path / "nope.jsonl"))
    path.write_text(json.dumps({"question_id": 1, "turns": []}) + "\n")
    with pytest.raises(ValueError, match="mine.jsonl:1: 'turns'"):
        questions.load_questions(str(path))
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="mine.jsonl:1: not JSON"):
        questions.load_questions(str(path))


def test_directory_draft_round_trip_and_refusals(cfg, target, tmp_path):
    """A directory draft loads with its lineage; one without a recorded target, or for another
    target's weights, tokenizer or template, is refused with the mismatch named."""
    torch.manual_seed(0)
    draft = GriffinDraft.for_target(target)
    drafts.save_draft_with_lineage(draft, tmp_path / "ok", target)
    loaded = drafts.load_draft_uri(tmp_path / "ok", target, cfg)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), draft.state_dict().values()))
    save_without_lineage(draft, tmp_path / "bare")
    with pytest.raises(ValueError, match="records no target fingerprint"):
        drafts.load_draft_uri(tmp_path / "bare", target, cfg)
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    config["provenance"]["target"]["tokenizer_sha256"] = "0" * 64
    (tmp_path / "ok" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"does not fit target 'tiny-llama': tokenizer_sha256: recorded"):
        drafts.load_draft_uri(tmp_path / "ok", target, cfg)
    with pytest.raises(FileNotFoundError, match="neither a directory"):
        drafts.load_draft_uri("no-such-draft", target, cfg)


def test_draft_paths_resolve_from_the_project_root(cfg, target, tmp_path, monkeypatch):
    """A shipped ``drafts/...`` path works from any working directory."""
    shipped = sorted(p.parent for p in (REPO / "drafts").glob("*/*/config.json"))
    relative = str(shipped[0].relative_to(REPO)) if shipped else "jobs"  # any folder of the project
    monkeypatch.chdir(tmp_path)
    assert drafts.resolve_draft(relative, cfg) == REPO / relative


def test_the_audit_hook_logs_opens_beside_the_checkout(tmp_path):
    """The suite's guard works: a process that opens a path beside the checkout is logged."""
    sys.path.insert(0, str(AUDIT))
    from sitecustomize import outside_checkout

    assert outside_checkout(str(REPO.parent / "a-sibling" / "data" / "x.jsonl"), str(REPO))
    assert not outside_checkout(str(REPO / "pipeline" / "resources" / "question_sets" / "mt_bench.jsonl"), str(REPO))
    # a checkout cloned into the temp folder: its siblings count, the tests' scratch there does not
    clone = os.path.join(os.path.realpath(tempfile.gettempdir()), "clone")
    assert outside_checkout(os.path.join(os.path.dirname(clone), "shared", "DESIGN.md"), clone)
    assert not outside_checkout(os.path.join(os.path.dirname(clone), "pytest-of-u", "t0", "x"), clone)
    assert not outside_checkout(os.path.join(os.path.dirname(clone), "HEAD"), clone)  # git's repository search
    log = tmp_path / "log"
    env = {**os.environ, "GRIFFIN_AUDIT_LOG": str(log)}
    code = f"open({str(REPO.parent / 'no-such-sibling' / 'f')!r})"
    subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    assert "no-such-sibling" in log.read_text()


def test_a_target_split_by_device_map_decodes_as_one(tmp_path, monkeypatch):
    """``target.device_map`` reaches transformers' ``from_pretrained`` (here "auto" over this machine's one
    device, the CPU: a split over several GPUs needs them), every layer's KV cache is placed on that
    layer's device, and decoding is the same as the target loaded whole. A tiny target refuses it."""
    from transformers import AutoModelForCausalLM

    from griffin.config import SamplingConfig, TreeConfig
    from griffin.decode import speculative_generate
    from pipeline.config import TargetSection

    tiny = {"model_type": "mistral", "sliding_window": 6, "hidden_size": 64, "intermediate_size": 96}
    tiny |= {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
    built = targets.load_target(TargetSection(name="tiny-mistral", dtype="float32", tiny=tiny))
    built.model.save_pretrained(tmp_path / "m")
    built.tokenizer.save_pretrained(tmp_path / "m")
    loads, load = [], AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(k) or load(*a, **k))
    whole = targets.load_target(TargetSection(name=str(tmp_path / "m"), dtype="float32"))
    split = targets.load_target(TargetSection(name=str(tmp_path / "m"), dtype="float32", device_map="auto"))
    assert [k["device_map"] for k in loads] == [None, "auto"]
    assert split.layer_devices == [torch.device("cpu")] * 3
    ids, tree = torch.arange(3, 23)[None], TreeConfig(total_tokens=8, depth=3, top_k=3)
    torch.manual_seed(0)
    draft = GriffinDraft.for_target(whole)
    runs = [speculative_generate(t, draft, ids, tree, SamplingConfig(), 12, stop_token_ids=[]) for t in (whole, split)]
    assert runs[0].tokens == runs[1].tokens
    with pytest.raises(ValueError, match="device_map apply to loaded weights"):
        targets.load_target(TargetSection(name="tiny-mistral", dtype="float32", tiny=tiny, device_map="auto"))
