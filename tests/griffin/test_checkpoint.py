"""griffin.checkpoint and griffin.export: strict save/load, parameter counts (docs/method.md §2.5), and each export
layout checked slot by slot against golden upstream key tables written out by hand (not from griffin.export_layouts)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

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


# Golden upstream layouts, written out by hand from the upstream code and NOT from griffin.export_layouts, so
# that a consistent mix-up of two same-shape slots in our maps (q/k, gate/up, the two fusion norms)
# fails here instead of surviving a round trip through our own exporter and importer. Each table is
# {upstream key: (our parameter, shape)} for the module's tiny target (MHA, as the official draft
# configs are).
H, I, V = TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"]
HEADS = TINY["num_attention_heads"]
EAGLE3_LAYERS = (1, 2)  # HF hidden_states indices of the 2-layer target: fc reads 2H
EAGLE3_TARGET_IDS = [1, 5, 9, 77]  # a reduced vocabulary, ascending as EAGLE-3's t2d mask implies
EAGLE3_D2T_OFFSETS = [1, 4, 7, 74]  # what EAGLE-3 files hold: target id - draft id
Table = dict[str, tuple[str, tuple[int, ...]]]


def llama_layer(prefix: str, attn_in: int, mlp_out: int) -> Table:
    """transformers' LlamaDecoderLayer without input_layernorm (EAGLE's first layer), as ``prefix``."""
    return {
        f"{prefix}.self_attn.q_proj.weight": ("layer.self_attn.q_proj.weight", (H, attn_in)),
        f"{prefix}.self_attn.k_proj.weight": ("layer.self_attn.k_proj.weight", (H, attn_in)),
        f"{prefix}.self_attn.v_proj.weight": ("layer.self_attn.v_proj.weight", (H, attn_in)),
        f"{prefix}.self_attn.o_proj.weight": ("layer.self_attn.o_proj.weight", (H, H)),
        f"{prefix}.post_attention_layernorm.weight": ("layer.post_attention_layernorm.weight", (H,)),
        f"{prefix}.mlp.gate_proj.weight": ("layer.mlp.gate_proj.weight", (I, H)),
        f"{prefix}.mlp.up_proj.weight": ("layer.mlp.up_proj.weight", (I, H)),
        f"{prefix}.mlp.down_proj.weight": ("layer.mlp.down_proj.weight", (mlp_out, I)),
    }


# The official GRIFFIN draft (github.com/hsj576/GRIFFIN, model/cnets_griffin_1.py ``Model``):
# ``fc = Efc`` computes h = fc.fc([e; f]), then fc.mlp(fc.post_attention_layernorm(h), e), where EMLP
# applies its one ``input_layernorm`` to both halves before up_proj (2H -> I) and down_proj (I -> H);
# ``layers.0`` is a LlamaDecoderLayer whose LlamaMLP.down_proj is I -> 2H (TEH).
GRIFFIN_OFFICIAL: Table = {
    "fc.fc.weight": ("fusion.fc.weight", (H, 2 * H)),
    "fc.fc.bias": ("fusion.fc.bias", (H,)),
    "fc.post_attention_layernorm.weight": ("fusion.fc_norm.weight", (H,)),  # RMSNorm_A, on fc's output
    "fc.mlp.input_layernorm.weight": ("fusion.expand_norm.weight", (H,)),  # RMSNorm_B, shared
    "fc.mlp.up_proj.weight": ("fusion.up_proj.weight", (I, 2 * H)),
    "fc.mlp.down_proj.weight": ("fusion.down_proj.weight", (H, I)),
    **llama_layer("layers.0", H, 2 * H),
}

# The official EAGLE draft (github.com/SafeAILab/EAGLE, eagle/model/cnets1.py ``Model``): ``fc =
# Linear(2H, H, bias)`` and one plain LlamaDecoderLayer.
EAGLE_OFFICIAL: Table = {
    "fc.weight": ("fusion.fc.weight", (H, 2 * H)),
    "fc.bias": ("fusion.fc.bias", (H,)),
    **llama_layer("layers.0", H, H),
}


def eagle3_official(prefix: str) -> Table:
    """EAGLE-3: vLLM speculators' ``Eagle3DraftModel`` (``layers.0``; speculators/models/eagle3) and
    SpecForge's ``LlamaForCausalLMEagle3`` (``midlayer``): fc over the k target layers without bias,
    the layer's input_layernorm on the embedding and hidden_norm on the fused features (attention
    2H wide), a final norm and a head over the draft vocabulary."""
    return {
        "fc.weight": ("feature_fc.weight", (H, len(EAGLE3_LAYERS) * H)),
        f"{prefix}.input_layernorm.weight": ("fusion.input_layernorm.weight", (H,)),
        f"{prefix}.hidden_norm.weight": ("fusion.hidden_norm.weight", (H,)),
        **llama_layer(prefix, 2 * H, H),
        "norm.weight": ("norm.weight", (H,)),
        "lm_head.weight": ("lm_head.weight", (len(EAGLE3_TARGET_IDS), H)),
    }


# ``--to hf`` (docs/design.md §6): transformers' CausalLM names, everything under ``model.``.
HF_GRIFFIN: Table = {
    "model.fc.weight": ("fusion.fc.weight", (H, 2 * H)),
    "model.fc.bias": ("fusion.fc.bias", (H,)),
    "model.fusion.fc_norm.weight": ("fusion.fc_norm.weight", (H,)),
    "model.fusion.expand_norm.weight": ("fusion.expand_norm.weight", (H,)),
    "model.fusion.up_proj.weight": ("fusion.up_proj.weight", (I, 2 * H)),
    "model.fusion.down_proj.weight": ("fusion.down_proj.weight", (H, I)),
    **llama_layer("model.layers.0", H, 2 * H),
}


def pattern(slot: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor no other slot holds: element j of slot s is (s + 1) * 100000 + j (exact in fp32)."""
    numel = math.prod(shape)
    assert numel < 100_000
    return ((slot + 1) * 100_000 + torch.arange(numel, dtype=torch.float32)).reshape(shape)


def official_llama_config() -> dict:
    """An official draft config.json (GRIFFIN's train/llama_3_instruct_8B_config.json, tiny): no
    ``bias`` key (the official loader then builds fc with a bias), MHA."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "hidden_act": "silu",
        "hidden_size": H,
        "intermediate_size": I,
        "max_position_embeddings": 512,
        "model_type": "llama",
        "num_attention_heads": HEADS,
        "num_hidden_layers": 1,
        "num_key_value_heads": HEADS,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": V,
    }


def eagle3_layer_config() -> dict:
    return {
        "model_type": "llama",
        "vocab_size": V,
        "hidden_size": H,
        "intermediate_size": I,
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": H // HEADS,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }


def speculators_config() -> dict:
    """vLLM speculators' Eagle3SpeculatorConfig as a draft trained with speculators carries it."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "transformer_layer_config": eagle3_layer_config(),
        "draft_vocab_size": len(EAGLE3_TARGET_IDS),
        "eagle_aux_hidden_state_layer_ids": list(EAGLE3_LAYERS),
        "norm_before_residual": False,
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "org/target"}},
    }


def specforge_config() -> dict:
    """SpecForge's flat LlamaForCausalLMEagle3 config; its layer ids name decoder-layer outputs (HF - 1)."""
    return {
        **eagle3_layer_config(),
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": len(EAGLE3_TARGET_IDS),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in EAGLE3_LAYERS],
            "use_aux_hidden_state": True,
        },
    }


OFFICIAL_GRIFFIN_CFG = DraftConfig(
    variant="griffin",
    hidden_size=H,
    intermediate_size=I,
    num_attention_heads=HEADS,
    num_key_value_heads=HEADS,
    vocab_size=V,
    rms_norm_eps=1e-05,
    rope_theta=500000.0,
    max_position_embeddings=512,
)
IMPORTS = {  # layout: (table, config.json, the DraftConfig it must give)
    "griffin-upstream/griffin": (GRIFFIN_OFFICIAL, official_llama_config(), OFFICIAL_GRIFFIN_CFG),
    "griffin-upstream/eagle": (
        EAGLE_OFFICIAL,
        official_llama_config(),
        OFFICIAL_GRIFFIN_CFG.model_copy(
            update=dict(variant="eagle", token_guided_fusion=False, token_enhanced_head=False)
        ),
    ),
    **{
        layout: (
            eagle3_official(prefix),
            config(),
            OFFICIAL_GRIFFIN_CFG.model_copy(
                update=dict(
                    variant="eagle3",
                    draft_vocab_size=len(EAGLE3_TARGET_IDS),
                    token_guided_fusion=False,
                    token_enhanced_head=False,
                    feature_layers=EAGLE3_LAYERS,
                    decoder_input="concat",
                    trainable_head=True,
                )
            ),
        )
        for layout, prefix, config in (
            ("speculators", "layers.0", speculators_config),
            ("specforge", "midlayer", specforge_config),
        )
    },
}


@pytest.mark.parametrize("case", sorted(IMPORTS))
def test_upstream_checkpoint_imports_each_slot(target, tmp_path, case):
    """A checkpoint written elsewhere (hand-built here from the upstream key names, a distinct tensor
    in every slot) loads with each of our parameters holding exactly the upstream tensor of the
    slot the golden table names, and with the DraftConfig its config.json describes."""
    table, config, cfg = IMPORTS[case]
    tensors = {key: pattern(slot, shape) for slot, (key, (_, shape)) in enumerate(table.items())}
    tensors["embed_tokens.weight"] = pattern(len(table), (V, H))  # every official draft carries it
    (tmp_path / CONFIG_NAME).write_text(json.dumps(config))
    if case.startswith("griffin-upstream"):
        torch.save(tensors, tmp_path / UPSTREAM_WEIGHTS_NAME)
    else:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[EAGLE3_TARGET_IDS] = True
        tensors.update(d2t=torch.tensor(EAGLE3_D2T_OFFSETS), t2d=t2d)
        save_file(tensors, tmp_path / WEIGHTS_NAME)
    imported = load_export(tmp_path, target)
    assert imported.cfg == cfg
    params = dict(imported.named_parameters())
    assert sorted(params) == sorted(ours for ours, _ in table.values())
    for key, (ours, _) in table.items():
        assert torch.equal(params[ours], tensors[key]), f"{ours} does not hold {key}"
    assert torch.equal(imported.embed_weight, target.embed_weight)  # the target's, not the file's copy
    if cfg.draft_vocab_size:
        assert imported.d2t.tolist() == EAGLE3_TARGET_IDS  # offsets back to target ids


EXPORTS = {  # layout/variant: (table, the file's embedding key)
    "griffin-upstream/griffin": (GRIFFIN_OFFICIAL, "embed_tokens.weight"),
    "griffin-upstream/eagle": (EAGLE_OFFICIAL, "embed_tokens.weight"),
    "hf/griffin": (HF_GRIFFIN, "model.embed_tokens.weight"),
    "speculators/eagle3": (eagle3_official("layers.0"), "embed_tokens.weight"),
    "specforge/eagle3": (eagle3_official("midlayer"), "embed_tokens.weight"),
}


@pytest.mark.parametrize("case", sorted(EXPORTS))
def test_export_writes_each_slot(target, tmp_path, case):
    """Each export key holds exactly the tensor of the parameter the golden table names (a draft
    with a distinct tensor in every parameter), plus the target's embedding (and, for EAGLE-3, the
    vocabulary as offsets and mask), and nothing else."""
    layout, variant = case.split("/")
    table, embed_key = EXPORTS[case]
    d2t = torch.tensor(EAGLE3_TARGET_IDS) if variant == "eagle3" else None
    draft = GriffinDraft.for_target(target, variant=variant, d2t=d2t)
    params = dict(draft.named_parameters())
    assert sorted(params) == sorted(ours for ours, _ in table.values())
    with torch.no_grad():
        for slot, (name, p) in enumerate(params.items()):
            p.copy_(pattern(slot, tuple(p.shape)))
    save_draft(draft, tmp_path / "d")
    out = export_draft(tmp_path / "d", tmp_path / "out", layout=layout, target=target)
    if layout == "griffin-upstream":
        tensors = torch.load(out / UPSTREAM_WEIGHTS_NAME, weights_only=True)
    else:
        tensors = load_file(out / WEIGHTS_NAME)
    extra = {embed_key}
    if variant == "eagle3":
        extra |= {"d2t", "t2d"}
        assert tensors["d2t"].tolist() == EAGLE3_D2T_OFFSETS
        assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].nonzero().flatten().tolist() == EAGLE3_TARGET_IDS
    assert sorted(tensors) == sorted(set(table) | extra)
    for key, (ours, shape) in table.items():
        assert tuple(tensors[key].shape) == shape, key
        assert torch.equal(tensors[key], params[ours]), f"{key} does not hold {ours}"
    assert torch.equal(tensors[embed_key], target.embed_weight)


@pytest.mark.parametrize("variant", ["griffin", "eagle"])
def test_upstream_export_config_alone_describes_draft(target, tmp_path, variant):
    """An upstream export stripped of our 'griffin' section, as official code would leave it, still
    gives back the draft's exact DraftConfig (from the LlamaConfig fields and ``bias``) and weights."""
    draft = draft_for(target, variant=variant)
    save_draft(draft, tmp_path / "d")
    out = export_draft(tmp_path / "d", tmp_path / "up", layout="griffin-upstream", target=target)
    config = json.loads((out / CONFIG_NAME).read_text())
    assert config["bias"] is True and config["architectures"] == ["LlamaForCausalLM"]
    for key in ("griffin", "provenance", "draft_vocab_size", "layout"):
        config.pop(key)
    (out / CONFIG_NAME).write_text(json.dumps(config))
    imported = load_export(out, target)
    assert imported.cfg == draft.cfg
    assert_same_weights(draft, imported)


def test_hf_export_keeps_reduced_vocab(target, tmp_path):
    """--to hf: model.* names, safetensors, d2t kept; reloads bit-exactly. Upstream refuses d2t."""
    draft = draft_for(target, d2t=torch.tensor([5, 9, 1, 77]))
    save_draft(draft, tmp_path / "d")
    out = export_draft(tmp_path / "d", tmp_path / "hf", layout="hf", target=target)
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
