"""griffin.checkpoint and griffin.export: strict save/load, export maps (docs/method.md §2.5) and their round trips."""

from __future__ import annotations

import json

import pytest
import torch

from griffin.config import DraftConfig
from griffin.model import GriffinDraft, count_trainable
from griffin.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_draft, save_draft, weights_sha256
from griffin.export import UPSTREAM_WEIGHTS_NAME, export_draft, load_export
from tests.conftest import TINY, make_target


def draft_for(target, variant="griffin", seed=0, **kwargs) -> GriffinDraft:
    torch.manual_seed(seed)
    draft = GriffinDraft.for_target(target, variant=variant, **kwargs)
    with torch.no_grad():  # norms start at 1 and the bias at 0-ish: randomise so a mix-up shows
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return draft


def draft_logits(draft: GriffinDraft) -> torch.Tensor:
    torch.manual_seed(1)
    features = torch.randn(1, 6, draft.cfg.hidden_size)
    tokens = torch.randint(0, 100, (1, 6))
    prediction, _ = draft([features], tokens)
    return draft.logits(prediction)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


def test_save_load_bit_exact(target, tmp_path):
    """save -> load gives the same tensors and the same logits; frozen tensors are not saved."""
    draft = draft_for(target)
    save_draft(draft, tmp_path / "d", provenance={"stage": 1})
    loaded = load_draft(tmp_path / "d", target)
    assert_same_weights(draft, loaded)
    assert torch.equal(draft_logits(draft), draft_logits(loaded))
    saved = json.loads((tmp_path / "d" / CONFIG_NAME).read_text())
    assert saved["provenance"] == {"stage": 1} and saved["bias"] is True
    save_draft(loaded, tmp_path / "again")  # the weights' identity survives a round trip
    assert weights_sha256(tmp_path / "again") == weights_sha256(tmp_path / "d")


def test_other_shape_lists_keys(target, tmp_path):
    """Loading GRIFFIN weights into an EAGLE-shaped draft names the missing and extra keys."""
    save_draft(draft_for(target), tmp_path / "d")
    config = json.loads((tmp_path / "d" / CONFIG_NAME).read_text())
    config["griffin"].update(variant="eagle", token_guided_fusion=False, token_enhanced_head=False)
    (tmp_path / "d" / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unexpected keys") as error:
        load_draft(tmp_path / "d", target)
    assert "fusion.up_proj.weight" in str(error.value) and "layer.mlp.down_proj.weight" in str(error.value)


def test_wrong_target_refused(target, tmp_path):
    save_draft(draft_for(target), tmp_path / "d")
    with pytest.raises(ValueError, match="hidden_size 64 != target 32"):
        load_draft(tmp_path / "d", make_target("llama", hidden_size=32, intermediate_size=64))


def test_reduced_vocab_round_trip(target, tmp_path):
    """The d2t map is saved and reloaded; the draft head is the target head's d2t rows."""
    d2t = torch.tensor([7, 3, 100, 2, 64, 127])
    draft = draft_for(target, d2t=d2t)
    save_draft(draft, tmp_path / "d")
    loaded = load_draft(tmp_path / "d", target)
    assert torch.equal(loaded.d2t, d2t) and loaded.cfg.draft_vocab_size == 6
    assert torch.equal(loaded.head_weight, target.head_weight[d2t])
    assert torch.equal(draft_logits(draft), draft_logits(loaded))


@pytest.mark.parametrize(
    "shape, trainable",
    [
        (dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, vocab_size=32000), 416_301_056),
        (dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, vocab_size=49152), 8_186_112),
    ],
)
def test_parameter_count(shape, trainable):
    """docs/method.md §2.5 (LLaMA2-7B and SmolLM2, MHA) trainable counts; built on meta."""
    cfg = DraftConfig(num_key_value_heads=shape["num_attention_heads"], **shape)
    with torch.device("meta"):
        frozen = torch.empty(shape["vocab_size"], shape["hidden_size"])
        draft = GriffinDraft(cfg, frozen, frozen)
    assert count_trainable(draft) == trainable


def upstream_table(H: int, I: int, V: int, griffin: bool = True) -> dict[str, tuple[int, ...]]:
    """docs/method.md §2.5's key list with its shapes, for hidden H, intermediate I, vocab V (MHA)."""
    fusion = (
        {
            "fc.fc.weight": (H, 2 * H),
            "fc.fc.bias": (H,),
            "fc.post_attention_layernorm.weight": (H,),
            "fc.mlp.input_layernorm.weight": (H,),
            "fc.mlp.up_proj.weight": (I, 2 * H),
            "fc.mlp.down_proj.weight": (H, I),
        }
        if griffin
        else {"fc.weight": (H, 2 * H), "fc.bias": (H,)}
    )
    return {
        "embed_tokens.weight": (V, H),
        **fusion,
        **{f"layers.0.self_attn.{p}_proj.weight": (H, H) for p in "qkvo"},
        "layers.0.post_attention_layernorm.weight": (H,),
        "layers.0.mlp.gate_proj.weight": (I, H),
        "layers.0.mlp.up_proj.weight": (I, H),
        "layers.0.mlp.down_proj.weight": ((2 if griffin else 1) * H, I),
    }


@pytest.mark.parametrize("variant", ["griffin", "eagle"])
def test_upstream_export(target, tmp_path, variant):
    """The upstream layout holds exactly §2.4's keys and shapes and reloads bit-exactly."""
    draft = draft_for(target, variant=variant)
    save_draft(draft, tmp_path / "d")
    out = export_draft(tmp_path / "d", tmp_path / "up", layout="griffin-upstream", target=target)
    state = torch.load(out / UPSTREAM_WEIGHTS_NAME, weights_only=True)
    expected = upstream_table(TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"], variant == "griffin")
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    assert torch.equal(state["embed_tokens.weight"], target.embed_weight)
    config = json.loads((out / CONFIG_NAME).read_text())
    assert config["bias"] is True and config["architectures"] == ["LlamaForCausalLM"]
    assert_same_weights(draft, load_export(out, target))


def test_official_checkpoint_import(target, tmp_path):
    """An upstream directory without our 'griffin' section (an official checkpoint) still loads."""
    draft = draft_for(target)
    save_draft(draft, tmp_path / "d")
    out = export_draft(tmp_path / "d", tmp_path / "up", layout="griffin-upstream", target=target)
    config = json.loads((out / CONFIG_NAME).read_text())
    for key in ("griffin", "provenance", "draft_vocab_size", "layout"):
        config.pop(key)
    (out / CONFIG_NAME).write_text(json.dumps(config))
    imported = load_export(out, target)
    assert imported.cfg == draft.cfg
    assert torch.equal(draft_logits(draft), draft_logits(imported))


def test_hf_export_keeps_reduced_vocab(target, tmp_path):
    """--to hf: model.* names, safetensors, d2t kept; reloads bit-exactly. Upstream refuses d2t."""
    draft = draft_for(target, d2t=torch.tensor([5, 9, 1, 77]))
    save_draft(draft, tmp_path / "d")
    out = export_draft(tmp_path / "d", tmp_path / "hf", layout="hf", target=target)
    from safetensors.torch import load_file

    names = set(load_file(out / WEIGHTS_NAME))
    assert {
        "model.embed_tokens.weight",
        "model.fc.weight",
        "model.fusion.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "d2t",
    } <= names
    assert all(n.startswith("model.") for n in names - {"d2t"})
    assert_same_weights(draft, load_export(out, target))
    with pytest.raises(ValueError, match="reduced vocabulary"):
        export_draft(tmp_path / "d", tmp_path / "up", layout="griffin-upstream", target=target)


def test_unknown_layout_refused(target, tmp_path):
    save_draft(draft_for(target), tmp_path / "d")
    with pytest.raises(ValueError, match="griffin-upstream"):
        export_draft(tmp_path / "d", tmp_path / "x", layout="vllm", target=target)
