"""Evaluation harness on the tiny target: datasets, metrics and the report files (in-process)."""

import json
from pathlib import Path

import pytest
import torch

from griffin.model import GriffinDraft
from pipeline.config import load_config
from pipeline.evaluate.evaluate import run_eval
from pipeline.evaluate.report import _acceptance
from pipeline.resources.drafts import save_draft_with_lineage
from pipeline.resources.targets import load_target

TINY = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "tiny.yaml"
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku.", "Now make it rhyme."]},
    {"question_id": 2, "category": "code", "turns": ["def add(a, b):"]},
    {"question_id": 3, "category": "math", "turns": ["What is 2 + 2?"]},
]


def test_acceptance_metrics():
    """tau counts the bonus token; alpha_k is conditional on reaching position k."""
    stats = _acceptance([0, 1, 3, 2], depth=3)
    assert stats["tau"] == (0 + 1 + 3 + 2 + 4) / 4
    assert stats["per_position_acceptance"] == [3 / 4, 2 / 3, 1 / 2]
    assert stats["acceptance_histogram"] == [1, 1, 1, 1]


def test_run_eval_writes_reports_with_baselines(tmp_path):
    """3 questions x T in {0, 1}: every method measured, T=0 lossless, report files written."""
    questions = tmp_path / "three.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    cfg = load_config(TINY, [f"output_dir={tmp_path}"])
    target = load_target(cfg.target)
    torch.manual_seed(0)
    draft_dir = save_draft_with_lineage(GriffinDraft.for_target(target), tmp_path / "draft", target)
    eagle_dir = save_draft_with_lineage(GriffinDraft.for_target(target, variant="eagle"), tmp_path / "eagle", target)
    assistant_dir = tmp_path / "assistant"  # the same tiny model saved, standing in for a smaller one
    target.model.save_pretrained(assistant_dir)
    target.tokenizer.save_pretrained(assistant_dir)
    cfg = load_config(
        TINY,
        [
            f"output_dir={tmp_path}",
            f"eval.datasets=[{questions}]",
            "eval.temperatures=[0, 1]",
            "eval.num_questions=3",
            "eval.max_new_tokens=8",
            f"eval.assistant_model={assistant_dir}",
            "eval.baselines=[vanilla, hf_generate, hf_prompt_lookup, hf_assisted]",
            f"eval.extra_drafts={{eagle: {eagle_dir}}}",
        ],
    )
    summary = run_eval(cfg, draft=str(draft_dir))

    methods = {"griffin", "eagle", "vanilla", "hf_generate", "hf_prompt_lookup", "hf_assisted"}
    assert set(summary["results"]) == {"three/T0", "three/T1"}
    for key, result in summary["results"].items():
        assert set(result["tokens_per_s"]) == methods
        assert set(result["speedup"]) == methods - {"griffin"}
        if key.endswith("/T0"):  # at T > 0 the methods sample different tokens: nothing to compare
            assert result["mismatches"] == 0
    eval_dir = tmp_path / "tiny" / "eval"
    for name in ["report.json", "report.md", "generations.jsonl", "tau.png", "speedup.png", "acceptance_histogram.png"]:
        assert (eval_dir / name).stat().st_size > 0, name
    report = json.loads((eval_dir / "report.json").read_text())
    assert "bonus token included" in report["definitions"]["tau"]
    for key, result in summary["results"].items():  # tau from the acceptance histogram: k accepted + 1
        histogram = report["results"][key]["methods"]["griffin"]["acceptance_histogram"]
        tau = sum((k + 1) * n for k, n in enumerate(histogram)) / sum(histogram)
        assert result["tau"] == pytest.approx(tau) and sum(histogram) >= 4  # a round per turn at least
    assert len(report["results"]["three/T0"]["methods"]["griffin"]["per_position_acceptance"]) == cfg.eval_tree.depth
    eagle = report["results"]["three/T0"]["methods"]["eagle"]  # in-process: its draft and verify cost per round
    assert 0 < eagle["draft_ms_per_round"] and 0 < eagle["verify_ms_per_round"]
    assert "draft_ms_per_round" not in report["results"]["three/T0"]["methods"]["griffin"]  # through Serve
    generations = [json.loads(line) for line in (eval_dir / "generations.jsonl").read_text().splitlines()]
    assert len(generations) == 2 * 4 * len(methods)  # T x (2 + 1 + 1 turns) x methods
    assert "| hf_prompt_lookup |" in (eval_dir / "report.md").read_text()
    assert summary["mlflow_run_id"]

    # the measured draft ships with a card that states what it delivers, and loads back bf16
    from safetensors.torch import load_file

    from pipeline.resources.drafts import load_draft_uri
    from pipeline.registry.ship import run_ship

    shipped = run_ship(cfg, source=str(draft_dir), report=str(eval_dir / "report.json"), out=str(tmp_path / "ship"))
    card = json.loads((tmp_path / "ship" / "card.json").read_text())
    assert card["tree"] == {k: report["tree"][k] for k in ("total_tokens", "depth", "top_k")}
    assert (
        set(card["measured"]) == {"three/T0", "three/T1"}
        and card["measured"]["three/T0"]["tau"] == summary["results"]["three/T0"]["tau"]
    )
    assert shipped["bytes"] < 30e6 and "griffin serve" in (tmp_path / "ship" / "README.md").read_text()
    assert (card["token_loss"], card["vocab_from"]) == (cfg.train.method.token_loss, cfg.draft.vocab_from)
    assert f"token loss `{card['token_loss']}`" in (tmp_path / "ship" / "README.md").read_text()
    weights = load_file(tmp_path / "ship" / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values() if t.is_floating_point())
    load_draft_uri(tmp_path / "ship", target, cfg)


def test_a_killed_eval_reruns_only_the_questions_it_had_not_finished(tmp_path, monkeypatch):
    """Killed in question 2, a rerun takes question 1 from the ledger, decodes 2 and 3, and reports all
    three; the ledger goes with the reports. A ledger from other settings is not reused."""
    from pipeline.evaluate import evaluate, methods

    questions = tmp_path / "three.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    cfg = load_config(
        TINY,
        [
            f"output_dir={tmp_path}",
            f"eval.datasets=[{questions}]",
            "eval.temperatures=[0]",
            "eval.num_questions=3",
            "eval.max_new_tokens=8",
            "eval.baselines=[vanilla]",
            "eval.through_serve=false",
        ],
    )
    target = load_target(cfg.target)
    torch.manual_seed(0)
    draft_dir = save_draft_with_lineage(GriffinDraft.for_target(target), tmp_path / "draft", target)
    real, calls = methods.speculative_generate, []

    def killed_in_question_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # the warm-up, question 1's two turns, then question 2
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(methods, "speculative_generate", killed_in_question_2)
    with pytest.raises(KeyboardInterrupt):
        run_eval(cfg, draft=str(draft_dir))
    ledger = tmp_path / "tiny" / "eval" / "unfinished.jsonl"
    lines = ledger.read_text().splitlines()
    assert len(lines) == 2  # the key, then question 1
    finished = json.loads(lines[1])["records"]
    assert [(r["question_id"], r["turn"]) for r in finished if r["method"] == "griffin"] == [(1, 1), (1, 2)]
    with open(ledger, "a") as out:  # a line the kill cut short
        out.write('{"dataset": "three", "temp')

    calls.clear()
    monkeypatch.setattr(methods, "speculative_generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    summary = run_eval(cfg, draft=str(draft_dir))
    assert len(calls) == 3  # the warm-up and questions 2 and 3 only
    assert summary["resumed_questions"] == 1 and not ledger.exists()
    generations = (tmp_path / "tiny" / "eval" / "generations.jsonl").read_text().splitlines()
    generations = [json.loads(line) for line in generations]
    assert len(generations) == 4 * 2  # (2 + 1 + 1 turns) x (griffin, vanilla)
    assert [g["text"] for g in generations[:4]] == [r["text"] for r in finished]
    assert summary["results"]["three/T0"]["mismatches"] == 0

    other = evaluate.EvalLedger(ledger, "another key")
    other.add("three", 0, 0, finished)
    assert evaluate.EvalLedger(ledger, "a third key").resumed == 0
    assert evaluate.EvalLedger(ledger, "a third key").get("three", 0, 0) is None


def test_griffin_run_reuses_a_finished_eval_only_with_the_same_settings(tmp_path, monkeypatch):
    """`griffin run` (reuse_finished) takes a finished evaluation's summary instead of decoding again,
    but only for the same config, weights and machine; `griffin eval` always measures afresh."""
    from pipeline.evaluate import evaluate, methods

    questions = tmp_path / "one.jsonl"
    questions.write_text(json.dumps(QUESTIONS[2]) + "\n")
    same = [
        f"output_dir={tmp_path}",
        f"eval.datasets=[{questions}]",
        "eval.temperatures=[0]",
        "eval.num_questions=1",
        "eval.max_new_tokens=6",
        "eval.baselines=[vanilla]",
        "eval.through_serve=false",
    ]
    cfg = load_config(TINY, same)
    target = load_target(cfg.target)
    torch.manual_seed(0)
    draft_dir = str(save_draft_with_lineage(GriffinDraft.for_target(target), tmp_path / "draft", target))
    real, calls = methods.speculative_generate, []
    monkeypatch.setattr(methods, "speculative_generate", lambda *a, **k: calls.append(1) or real(*a, **k))

    first = run_eval(cfg, draft=draft_dir, reuse_finished=True)  # nothing finished yet: measured
    assert len(calls) == 2  # the warm-up and the question
    calls.clear()
    assert run_eval(cfg, draft=draft_dir, reuse_finished=True) == json.loads(json.dumps(first, default=str))
    assert calls == []
    for changed in ("eval.max_new_tokens=5", "decode.tree.total_tokens=6", "eval.seed=1"):
        calls.clear()
        run_eval(load_config(TINY, [*same, changed]), draft=draft_dir, reuse_finished=True)
        assert len(calls) == 2, changed
    calls.clear()
    run_eval(cfg, draft=draft_dir)  # `griffin eval`: measured again even with the same settings
    assert len(calls) == 2
    monkeypatch.setattr(evaluate, "machine_identity", lambda: {"processor": "another machine"})
    calls.clear()
    run_eval(cfg, draft=draft_dir, reuse_finished=True)
    assert len(calls) == 2
