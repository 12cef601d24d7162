"""``griffin check-target``: the right verdict on a supported, an unsupported and a broken tiny target."""

import json

import yaml

from griffin.families import AttentionLayout
from pipeline.cli import main

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
GPT_OSS = dict(model_type="gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, **TINY)


def config(tmp_path, tiny: dict) -> str:
    path = tmp_path / "target.yaml"
    body = {
        "run_name": "check",
        "output_dir": str(tmp_path / "out"),
        "target": {"name": f"tiny-{tiny['model_type']}", "dtype": "float32", "tiny": tiny},
        "decode": {"tree": {"total_tokens": 8, "depth": 3, "top_k": 3}},
    }
    path.write_text(yaml.safe_dump(body))
    return str(path)


def verdict(capsys) -> dict:
    out = capsys.readouterr().out
    return json.loads(out[out.rindex("\n{\n") + 1 :]), out


def test_a_supported_windowed_target_is_lossless(tmp_path, capsys):
    assert main(["check-target", "-c", config(tmp_path, GPT_OSS)]) == 0
    report, out = verdict(capsys)
    assert report["verdict"] == "lossless" and report["family"] == "gpt-oss"
    assert report["prompt_tokens"] > 8  # longer than the window
    assert "sliding window of 8 tokens on 2 of 4 layers" in out and "speculative, batched: identical" in out


def test_an_unsupported_family_is_refused_by_name(tmp_path, capsys):
    tiny = dict(model_type="lfm2", **TINY)
    assert main(["check-target", "-c", config(tmp_path, tiny)]) == 1
    report, _ = verdict(capsys)
    assert report["verdict"] == "refused"
    assert "'lfm2' is not supported: recurrent or linear-attention layers" in report["reason"]
    assert "gpt-oss (gpt_oss)" in report["reason"]  # and the supported families


def test_config_only_loads_no_weights(tmp_path, capsys, monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("--config-only loaded the target")

    monkeypatch.setattr("pipeline.resources.targets.load_target", no_weights)
    assert main(["check-target", "-c", config(tmp_path, GPT_OSS), "--config-only"]) == 0
    assert verdict(capsys)[0]["verdict"] == "supported (config only)"


def test_a_verify_mask_that_ignores_the_window_is_caught(tmp_path, capsys, monkeypatch):
    """The check can fail: with the windowed layers' masks left full, it reports the first divergence."""
    monkeypatch.setattr(AttentionLayout, "_in_window", lambda self, positions, width: True)
    assert main(["check-target", "-c", config(tmp_path, GPT_OSS)]) == 1
    report, out = verdict(capsys)
    assert report["verdict"] == "diverged" and report["check"] == "speculative, alone"
    first = report["first_divergence"]  # in fp32 any difference is a divergence, near-tie or not
    assert first["spec_token"] != first["vanilla_token"] and first["gap"] is not None and "verdict: DIVERGED" in out


def test_bad_flags_are_named(tmp_path, capsys):
    assert main(["check-target", "-c", config(tmp_path, GPT_OSS), "--prompts", "1"]) == 2
    assert "--prompts 1" in capsys.readouterr().err
