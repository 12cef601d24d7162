"""``griffin tune-tree``: the search logic, the cost curve and the CLI run on the tiny target."""

import json
from pathlib import Path

import pytest
import torch

from griffin.config import TreeConfig
from griffin.model import GriffinDraft
from pipeline.cli import main
from pipeline.config import load_config
from pipeline.resources.drafts import save_draft_with_lineage
from pipeline.resources.targets import load_target
from pipeline.run import tuned_decode
from pipeline.evaluate.tune import Candidate, coordinate_search, reusable_tuning, run_tune_tree, verify_cost_curve

TINY = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "tiny.yaml"


def test_a_tree_must_beat_plain_rows_by_the_margin_to_be_picked():
    """A measured tie goes to plain rows (84.1 vs 83.8 tokens/s measured one way was 0.85x served)."""
    from pipeline.evaluate.batch_policy import PLAIN_MARGIN, pick

    small, wide = TreeConfig(total_tokens=4, depth=1, top_k=3), TreeConfig(total_tokens=12, depth=3, top_k=10)
    options = [None, small, wide]
    assert pick(options, [83.8, 84.1, 70.0]) is None
    assert pick(options, [80.0, 80.0 * PLAIN_MARGIN + 0.1, 90.0]) == wide
    assert pick(options, [100.0, 90.0, 80.0]) is None


def test_coordinate_search_finds_the_peak_of_a_known_surface():
    """A synthetic speed surface peaked at (16, 5, 4): the search finds it and never scores a
    tree twice or one that TreeConfig refuses."""
    calls = []

    def score(tree: TreeConfig) -> Candidate:
        calls.append((tree.total_tokens, tree.depth, tree.top_k))
        speed = 100 - abs(tree.total_tokens - 16) - 3 * abs(tree.depth - 5) - 2 * abs(tree.top_k - 4)
        return Candidate(tree.total_tokens, tree.depth, tree.top_k, 2.0, 1.0, 1.0, float(speed))

    best, ranked = coordinate_search(score, TreeConfig(total_tokens=8, depth=3, top_k=2))
    assert (best.total_tokens, best.depth, best.top_k) == (16, 5, 4)
    assert len(calls) == len(set(calls)) == len(ranked)
    assert ranked == sorted(ranked, key=lambda c: -c.tokens_per_s)


def test_verify_cost_curve_times_the_engines_verify_phase(monkeypatch):
    """The curve times the engine's own batched verify pass (what serving runs), every size after an
    untimed repetition, in an engine sized for every tree of the search; the row it verified in then
    leaves, its slot zeroed (griffin.rows' invariant)."""
    from griffin.engine import BatchEngine
    from pipeline.evaluate.tune import SEARCH_POLICY

    target = load_target(load_config(TINY).target)
    engines, widths, forward = [], [], BatchEngine._verify_forward

    def recording(engine, batch):
        engines.append(engine)
        widths.append(batch.tokens.shape[1])
        return forward(engine, batch)

    monkeypatch.setattr(BatchEngine, "_verify_forward", recording)
    curve = verify_cost_curve(target, GriffinDraft.for_target(target), (1, 4, 8), repeats=2)
    assert set(curve) == {1, 4, 8} and all(ms > 0 for ms in curve.values())
    assert sorted(widths) == [1] * 4 + [4] * 3 + [8] * 3  # the prefill's plain round, then 3 repetitions
    (engine,) = set(engines)
    assert engine.tree_slack == SEARCH_POLICY.tree_slack and not engine.busy
    assert not any(tensors.keys.any() or tensors.values.any() for tensors in engine.cache.tensors)


def test_tune_tree_cli_writes_the_report(tmp_path, capsys):
    cfg = load_config(TINY, [f"output_dir={tmp_path}"])
    torch.manual_seed(0)
    target = load_target(cfg.target)
    draft_dir = save_draft_with_lineage(GriffinDraft.for_target(target), tmp_path / "draft", target)
    code = main(
        [
            "tune-tree",
            "-c",
            str(TINY),
            f"output_dir={tmp_path}",
            "--draft",
            str(draft_dir),
            "--prompts",
            "2",
            "--max-new-tokens",
            "6",
            "eval.datasets=[mt_bench]",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "best tree:" in printed and "decode.tree.total_tokens=" in printed
    assert "at T=1:" in printed and "decode.sampling_tree.total_tokens=" in printed
    report = json.loads((tmp_path / cfg.run_name / "tune_tree" / "tune_tree.json").read_text())
    best = report["best"]
    assert best in report["candidates"] and report["sampling"]["best"] in report["sampling"]["candidates"]
    assert report["sampling"]["temperature"] == 1.0
    # every candidate's expected speed is its measured tau over its draft + verify time, its verify
    # time the curve's at its size; the speedup is the best's speed over vanilla
    curve = {int(n): ms for n, ms in report["verify_ms_by_tokens"].items()}
    for c in report["candidates"]:
        assert c["verify_ms"] == pytest.approx(curve[c["total_tokens"]])
        assert c["tokens_per_s"] == pytest.approx(1e3 * c["tau"] / (c["draft_ms"] + c["verify_ms"]))
    assert report["expected_speedup"] == pytest.approx(best["tokens_per_s"] / report["vanilla_tokens_per_s"])
    TreeConfig(total_tokens=best["total_tokens"], depth=best["depth"], top_k=best["top_k"])  # a valid tree
    assert report["settings"]["prompts"] == 2 and len(report["verify_ms_by_tokens"]) == 11
    assert (tmp_path / cfg.run_name / "tune_tree" / "tune_tree.png").stat().st_size > 0
    # the serving policy: every batch size measured, plain decoding among the options, batch 1 = the best tree
    policy = report["policy"]
    assert (
        sorted(int(b) for b in policy) == [1, 2, 4, 8]
        and policy["1"] == TreeConfig(**{k: best[k] for k in ("total_tokens", "depth", "top_k")}).model_dump()
    )
    assert {row["batch"] for row in report["policy_curve"]} == {1, 2, 4, 8}
    assert all(any(r["batch"] == b and r["tree"] == "plain" for r in report["policy_curve"]) for b in (1, 2, 4, 8))
    assert "| batch |" in (tmp_path / cfg.run_name / "tune_tree" / "tune_tree.md").read_text()
    # the sampling rounds' policy: measured at T=1 per batch size, one of the T=1 search's trees or plain rows
    sampling, sampled = report["sampling"]["policy"], report["sampling"]["best"]
    assert sorted(int(b) for b in sampling) == [1, 2, 4, 8]
    assert sampling["1"] == TreeConfig(**{k: sampled[k] for k in ("total_tokens", "depth", "top_k")}).model_dump()
    assert {(r["batch"], r["tree"]) for r in report["sampling"]["policy_curve"]} >= {(8, "plain"), (1, "plain")}
    assert "decode.sampling_policy" in (tmp_path / cfg.run_name / "tune_tree" / "tune_tree.md").read_text()
    # griffin run's reading of it: both policies, their batch-1 trees the searched ones; a tuning written
    # before the sampling policy was measured keeps the config's
    base = load_config(TINY, [f"output_dir={tmp_path}", "decode.sampling_policy={1: null}"])
    tuned = base.model_copy(update={"decode": tuned_decode(base.decode, report)}).speculation_policy
    assert tuned.describe() == {int(b): t for b, t in policy.items()}
    assert tuned.describe_sampling() == {int(b): t for b, t in sampling.items()}
    old = {**report, "sampling": {k: v for k, v in report["sampling"].items() if k != "policy"}}
    assert tuned_decode(base.decode, old).sampling_policy == {1: None}


def test_a_finished_tuning_is_reused_only_with_the_same_settings(tmp_path):
    """`griffin run` reuses tune_tree.json for the same draft, calibration, search and machine, and
    tunes again when any of them changed."""
    same = [
        f"output_dir={tmp_path}",
        "decode.tune_prompts=1",
        "decode.tune_max_new_tokens=4",
        "decode.tune_sweeps=1",
        "eval.datasets=[mt_bench]",
    ]
    cfg = load_config(TINY, same)
    torch.manual_seed(0)
    target = load_target(cfg.target)
    draft_dir = str(save_draft_with_lineage(GriffinDraft.for_target(target), tmp_path / "draft", target))
    relative = f"{draft_dir}/../draft"  # the same directory, spelled differently
    assert reusable_tuning(cfg, draft_dir) is None  # nothing tuned yet
    tuned = run_tune_tree(cfg, draft=draft_dir)
    assert reusable_tuning(cfg, draft_dir)["best"] == tuned["best"]  # the tuning just run, read back
    assert reusable_tuning(cfg, relative) is not None
    assert reusable_tuning(cfg, str(tmp_path / "another-draft")) is None
    for changed in (
        "decode.tune_prompts=2",
        "decode.tune_max_new_tokens=8",
        "decode.tune_sweeps=2",
        "eval.datasets=[humaneval]",
        "decode.tree.total_tokens=6",
    ):
        assert reusable_tuning(load_config(TINY, [*same, changed]), draft_dir) is None, changed


def test_tuning_decodes_compiled_targets_outside_inference_mode():
    """Compiled decode steps cannot take inference tensors (griffin.static): tune-tree's greedy reference
    and the batch-policy measurement let the engine choose its own mode. A stand-in compiled step (the
    eager forward, checking the mode it is called in) stands for the real graph."""
    from griffin.replay import decode_reference
    from pipeline.evaluate.batch_policy import measure_policy
    from tests.conftest import make_target

    target = make_target("llama")
    modes: list[bool] = []

    def compiled_step(*args):
        modes.append(torch.is_inference_mode_enabled())
        return target._forward(*args)

    target.compiled_forward = compiled_step
    decode_reference(target, torch.tensor([[5, 6, 7]]), 6, 2, stop_token_ids=[])
    measure_policy(target, None, [[5, 6, 7], [8, 9]], [], [1, 2], 4, reps=1)
    assert modes and not any(modes)
