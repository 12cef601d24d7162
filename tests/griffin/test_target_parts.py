"""What a draft borrows from its target, read by name from the target's files (griffin.target_parts):
equal to the whole target's tensors for every supported family, and nothing else read."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from griffin.families import FAMILIES
from griffin.target_parts import PartsUnreadable, read_target_parts
from tests.griffin.test_families import build

# families whose checkpoint stores a decoder layer under other names than the model's (transformers
# converts them at load: MoE experts stored one by one, fused in the model)
CONVERTED_LAYERS = {
    "apertus", "deepseek_v2", "deepseek_v3", "ernie4_5_moe", "granitemoe", "granitemoeshared", "hunyuan_v1_moe",
    "mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_moe",
}  # fmt: skip


def saved(model_type: str, folder, **extra):
    """A tiny target of ``model_type`` saved in several safetensors files with an index; reloaded as
    transformers loads it (the reference: whatever conversion it applies at load)."""
    build(model_type, **extra).model.save_pretrained(folder, max_shard_size="200KB")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_parts_equal_the_whole_targets_tensors(tmp_path, model_type):
    """Embedding, head (one tensor when tied), final norm and, when asked, the last layer, as the
    loaded target has them, reading exactly those tensors. A layer stored under other names than the
    model's (an MoE's experts, fused by transformers at load) is refused: the caller loads it whole."""
    whole = saved(model_type, tmp_path)
    embed, head = whole.get_input_embeddings().weight, whole.get_output_embeddings().weight
    norm = getattr(whole.get_decoder(), "norm", None)
    norm_state = norm.state_dict() if isinstance(norm, torch.nn.Module) else {}
    borrowed = sum(t.nbytes for t in (embed, *([] if head is embed else [head]), *norm_state.values()))
    parts = read_target_parts(str(tmp_path), torch.float32)
    assert torch.equal(parts.embed_weight, embed) and torch.equal(parts.head_weight, head)
    assert (parts.head_weight is parts.embed_weight) == (head is embed)
    ours = parts.backbone.norm.state_dict() if norm_state else {}
    assert ours.keys() == norm_state.keys() and all(torch.equal(ours[k], norm_state[k]) for k in ours)
    assert parts.backbone.layers == [None] * whole.config.num_hidden_layers
    assert parts.bytes_read == borrowed < parts.file_bytes
    try:
        parts = read_target_parts(str(tmp_path), torch.float32, layer=-1)
    except PartsUnreadable:
        assert model_type in CONVERTED_LAYERS
        return
    assert model_type not in CONVERTED_LAYERS
    ours, theirs = parts.backbone.layers[-1].state_dict(), whole.get_decoder().layers[-1].state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert parts.bytes_read == borrowed + sum(t.nbytes for t in theirs.values())


def test_a_checkpoint_with_other_names_is_refused_by_name(tmp_path):
    saved("llama", tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    tensors = {}
    for file in sorted(tmp_path.glob("model-*.safetensors")):
        tensors |= {name.replace("model.", "transformer."): t for name, t in load_file(file).items()}
        file.unlink()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(PartsUnreadable, match="holds no tensor named model.embed_tokens.weight"):
        read_target_parts(str(tmp_path), torch.float32)


def test_bf16_parts_on_request(tmp_path):
    saved("qwen2", tmp_path)
    parts = read_target_parts(str(tmp_path), torch.bfloat16, layer=0)
    assert parts.dtype == parts.backbone.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_a_target_without_safetensors_is_refused_by_name(tmp_path):
    """Weights only as pytorch_model.bin: the parts cannot be read by name; the caller loads it whole."""
    model = build("llama").model
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(PartsUnreadable, match="has no safetensors weights"):
        read_target_parts(str(tmp_path), torch.float32)
