"""griffin export --to speculators | specforge: EAGLE-3 drafts in the layouts vLLM and SGLang load,
checked by vLLM speculators' own loader and converter (requirements-speculators.txt)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from griffin.model import GriffinDraft
from griffin.checkpoint import CONFIG_NAME, WEIGHTS_NAME, save_draft
from griffin.export import export_draft, load_export
from tests.conftest import make_target

SPECULATORS_SITE = Path(sys.prefix) / "speculators"  # `make test` installs it there
D2T = [5, 9, 1, 77, 3, 100, 64]  # unsorted on purpose: EAGLE-3's t2d mask needs ascending ids


@pytest.fixture(scope="module")
def target():
    return make_target("llama", num_hidden_layers=8)  # layers 2, 4, 5: three distinct feature layers


def eagle3_draft(target, d2t=D2T, variant="eagle3") -> GriffinDraft:
    torch.manual_seed(0)
    draft = GriffinDraft.for_target(target, variant=variant, d2t=None if d2t is None else torch.tensor(d2t))
    with torch.no_grad():  # norms start at 1 and the head at the target's rows: randomise so a mix-up shows
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return draft


def first_step_logits(draft: GriffinDraft, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    prediction, _ = draft([features], tokens)  # (1, T, D)
    return draft.logits(prediction)  # (1, T, V_draft)


def test_eagle3_layouts_names_and_vocabulary(target, tmp_path):
    """Both layouts hold EAGLE-3's names, offset d2t and the t2d mask; the vocabulary is reordered to
    ascending target ids without changing what the draft computes; both reload bit-exactly."""
    draft = eagle3_draft(target)
    save_draft(draft, tmp_path / "d")
    torch.manual_seed(1)
    features, tokens = torch.randn(1, 9, draft.cfg.input_feature_size), torch.randint(0, 128, (1, 9))
    ours = first_step_logits(draft, features, tokens)  # draft ids in D2T's order
    order = torch.argsort(torch.tensor(D2T))
    for layout, layer in (("speculators", "layers.0"), ("specforge", "midlayer")):
        out = export_draft(tmp_path / "d", tmp_path / layout, layout=layout, target=target, verifier="org/target")
        tensors = load_file(out / WEIGHTS_NAME)
        assert {
            "fc.weight",
            f"{layer}.hidden_norm.weight",
            f"{layer}.input_layernorm.weight",
            f"{layer}.self_attn.q_proj.weight",
            "norm.weight",
            "lm_head.weight",
            "embed_tokens.weight",
            "d2t",
            "t2d",
        } <= set(tensors)
        assert (
            tensors["fc.weight"].shape == (64, 3 * 64) and tensors[f"{layer}.self_attn.q_proj.weight"].shape[1] == 128
        )
        ids = sorted(D2T)
        assert tensors["d2t"].tolist() == [t - i for i, t in enumerate(ids)]  # target id = draft id + d2t
        assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].nonzero().flatten().tolist() == ids
        assert torch.equal(tensors["embed_tokens.weight"], target.embed_weight)
        reloaded = load_export(out, target)
        assert reloaded.d2t.tolist() == ids
        torch.testing.assert_close(first_step_logits(reloaded, features, tokens), ours[..., order], rtol=0, atol=1e-6)
    config = json.loads((tmp_path / "speculators" / CONFIG_NAME).read_text())
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": "org/target",
        "architectures": ["LlamaForCausalLM"],
    }
    flat = json.loads((tmp_path / "specforge" / CONFIG_NAME).read_text())
    assert flat["architectures"] == ["LlamaForCausalLMEagle3"] and flat["draft_vocab_size"] == len(D2T)
    # SGLang's numbering: layer outputs, one below HF's hidden_states indices (it captures id + 1)
    assert flat["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]


def test_foreign_eagle3_draft_imports(target, tmp_path):
    """A speculators or SpecForge directory written elsewhere (no 'griffin' section) loads here
    (``load_export``): its DraftConfig comes from their config fields."""
    draft = eagle3_draft(target, d2t=None)
    save_draft(draft, tmp_path / "d")
    torch.manual_seed(2)
    features, tokens = torch.randn(1, 5, draft.cfg.input_feature_size), torch.randint(0, 128, (1, 5))
    for layout in ("speculators", "specforge"):
        out = export_draft(tmp_path / "d", tmp_path / layout, layout=layout, target=target)
        config = json.loads((out / CONFIG_NAME).read_text())
        for key in ("griffin", "provenance", "layout"):
            config.pop(key)
        (out / CONFIG_NAME).write_text(json.dumps(config))
        imported = load_export(out, target)
        assert imported.cfg.model_dump() == {**draft.cfg.model_dump(), "fc_bias": imported.cfg.fc_bias}
        assert torch.equal(first_step_logits(imported, features, tokens), first_step_logits(draft, features, tokens))
        config.pop("eagle_aux_hidden_state_layer_ids", None)
        config.pop("eagle_config", None)
        (out / CONFIG_NAME).write_text(json.dumps(config))
        with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
            load_export(out, target)


@pytest.mark.parametrize("variant", ["griffin3", "griffin", "hass"])
def test_other_variants_refuse_eagle3_layouts(target, tmp_path, variant):
    save_draft(eagle3_draft(target, variant=variant), tmp_path / "d")
    with pytest.raises(ValueError, match="--to hf"):
        export_draft(tmp_path / "d", tmp_path / "x", layout="speculators", target=target)
    out = export_draft(tmp_path / "d", tmp_path / "hf", layout="hf", target=target)  # every variant has hf
    assert load_export(out, target).cfg.variant == variant


def test_speculators_loads_our_exports(target, tmp_path):
    """vLLM speculators (pinned, installed beside the venv) loads the speculators export and, through
    its own converter, the SpecForge export: every weight as written, and its first draft step
    computes our logits (fp32)."""
    if not (SPECULATORS_SITE / "speculators").is_dir():
        pytest.fail(
            f"speculators is not installed in {SPECULATORS_SITE}: run `make test` (or "
            "`make .venv/speculators/.installed`)"
        )
    draft = eagle3_draft(target)
    save_draft(draft, tmp_path / "d")
    verifier = tmp_path / "verifier"  # the target as a checkpoint directory, which the converter reads
    target.model.save_pretrained(verifier)
    for layout in ("speculators", "specforge"):
        export_draft(tmp_path / "d", tmp_path / layout, layout=layout, target=target, verifier=str(verifier))
    exported = load_export(tmp_path / "speculators", target)  # vocabulary in ascending order, as they hold it
    torch.manual_seed(3)
    features, tokens = torch.randn(1, 11, draft.cfg.input_feature_size), torch.randint(0, 128, (1, 11))
    torch.save(
        {"features": features, "tokens": tokens, "logits": first_step_logits(exported, features, tokens).detach()},
        tmp_path / "reference.pt",
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SPECULATORS_SITE), str(Path.cwd())])}
    run = subprocess.run(
        [
            sys.executable,
            "tests/griffin/speculators_check.py",
            str(tmp_path / "speculators"),
            str(tmp_path / "specforge"),
            str(verifier),
            str(tmp_path / "reference.pt"),
            str(tmp_path / "converted"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    reports = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["layout"] for r in reports] == ["speculators", "specforge"]
    direct = load_file(tmp_path / "speculators" / WEIGHTS_NAME)
    for report in reports:
        assert report["config"] == "Eagle3SpeculatorConfig" and report["layers"] == [2, 4, 5]
        assert report["draft_vocab_size"] == len(D2T) and report["verifier"] == str(verifier)
        # the file holds every weight their model has, except the verifier's own head and norm (training only)
        assert set(report["model_keys"]) - set(report["file_keys"]) == {
            "verifier_lm_head.weight",
            "verifier_norm.weight",
        }
        assert set(report["file_keys"]) == set(direct)
        assert report["weight_diff"] == 0.0 and report["d2t"] == direct["d2t"].tolist()
        assert report["logit_diff"] < 1e-5, report["logit_diff"]
    converted = load_file(tmp_path / "converted" / WEIGHTS_NAME)
    assert all(torch.equal(converted[k].to(v.dtype), v) for k, v in direct.items())
