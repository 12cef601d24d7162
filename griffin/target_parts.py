"""What a draft borrows from its target, read without building the target: the token embedding, the
LM head (the embedding itself when tied), the final norm and, for ``draft.init_layer``, one decoder
layer. A training worker needs nothing else, and at 32 workers the whole target per worker is what
fills a node's RAM and its reads (docs/scaling.md §4.7): an 8B target is 16 GB, its embedding and
head 2.1 GB (bf16).

The tensors' names come from the model built on the meta device (no memory, no weights read); the
tensors come from the target's safetensors files by name, the index saying which file holds which.
A checkpoint whose names differ from the model's (a conversion transformers applies at load) is
refused with ``PartsUnreadable``; the caller then loads the whole target.

Shape legend: V vocab, D hidden.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM

from griffin.families import AttentionLayout
from griffin.target_files import WEIGHT_LAYOUTS, locate

SINGLE, INDEX = WEIGHT_LAYOUTS[0]  # the safetensors pair


class PartsUnreadable(LookupError):
    """The target's files do not hold the parts under the model's own names."""


class HeadShaped:
    """Device, dtype and sizes read off ``head_weight`` and ``hf_config``: the same for a whole target
    (``griffin.target.TargetAdapter``) and for its parts."""

    hf_config: Any
    head_weight: Tensor

    @property
    def device(self) -> torch.device:
        return self.head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head_weight.dtype

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.head_weight.shape[0]


@dataclass
class TargetParts(HeadShaped):
    """The part of ``griffin.target.TargetAdapter`` a draft reads (``GriffinDraft.for_target``,
    ``griffin.checkpoint.load_draft``); ``backbone.layers`` holds only the requested layer."""

    name: str
    hf_config: Any
    embed_weight: Tensor  # (V, D)
    head_weight: Tensor  # (V, D); the embedding itself when tied
    backbone: nn.Module  # .norm (the final norm, when the family has one) and .layers (None but one)
    bytes_read: int = 0  # bytes read from the target's weight files
    file_bytes: int | None = None  # of every local weight file: what loading the whole target reads

    @classmethod
    def of(cls, target: Any, layer: int | None = None) -> "TargetParts":
        """The parts of a target already in memory (a tiny target is built, not read)."""
        layers: list[nn.Module | None] = [None] * target.hf_config.num_hidden_layers
        if layer is not None:
            layers[layer] = target.backbone.layers[layer]
        backbone = _backbone(getattr(target.backbone, "norm", None), layers)
        return cls(target.name, target.hf_config, target.embed_weight, target.head_weight, backbone)


def _backbone(norm: nn.Module | None, layers: list[nn.Module | None]) -> nn.Module:
    backbone: Any = nn.Module()
    backbone.norm = norm
    backbone.layers = layers
    return backbone


def meta_model(path: str, revision: str | None = None) -> tuple[Any, Any]:
    """(config, model on the meta device) of a local directory or an HF hub id: the target's shapes and
    parameter names, no memory, no weights read; its family refused as loading it would refuse it."""
    config = AutoConfig.from_pretrained(path, revision=revision)
    AttentionLayout.of(config)
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config)


def read_target_parts(
    path: str, dtype: torch.dtype, device: str = "cpu", layer: int | None = None, revision: str | None = None
) -> TargetParts:
    """``path``: a local directory or an HF hub id (``griffin.assets.resolve_target_path``); the family
    is checked as for the whole target. Tensors are cast to ``dtype`` on ``device``."""
    config, skeleton = meta_model(path, revision)
    names = {id(p): n for n, p in skeleton.named_parameters()}  # a tied tensor: its first name, as saved
    embed = skeleton.get_input_embeddings().weight
    head = skeleton.get_output_embeddings().weight
    decoder = skeleton.get_decoder()
    norm = getattr(decoder, "norm", None)
    modules = {"norm": norm} if isinstance(norm, nn.Module) and any(True for _ in norm.parameters()) else {}
    if layer is not None:
        modules["layer"] = decoder.layers[layer]
    wanted = {"embed": names[id(embed)]} | ({} if head is embed else {"head": names[id(head)]})
    for key, module in modules.items():  # every parameter of the module (a norm's bias too), by its saved name
        wanted |= {f"{key}/{local}": names[id(p)] for local, p in module.named_parameters()}
    files = WeightFiles(path, revision)
    tensors = files.read(list(wanted.values()))
    cast = {key: tensors[name].to(device=device, dtype=dtype) for key, name in wanted.items()}
    built = {
        key: _materialise(module, {k.split("/", 1)[1]: t for k, t in cast.items() if k.startswith(key + "/")}, device)
        for key, module in modules.items()
    }
    layers: list[nn.Module | None] = [None] * config.num_hidden_layers
    if layer is not None:
        layers[layer] = built["layer"]
    embed_weight = cast["embed"]
    head_weight = embed_weight if head is embed else cast["head"]
    backbone = _backbone(built.get("norm"), layers)
    return TargetParts(path, config, embed_weight, head_weight, backbone, files.bytes_read, files.total_bytes)


def _materialise(module: nn.Module, state: dict[str, Tensor], device: str) -> nn.Module:
    """A meta module given real tensors: every parameter from ``state``; a buffer it cannot get is refused."""
    buffers = [n for n, _ in module.named_buffers()]
    if buffers:
        raise PartsUnreadable(f"{type(module).__name__} holds buffers ({', '.join(buffers)}) the files do not")
    module.to_empty(device=device)
    module.load_state_dict(state, strict=True, assign=True)
    return module.requires_grad_(False)


class WeightFiles:
    """A target's safetensors files: which file holds each tensor (the index, or the one file), read
    by name. A hub id's files are fetched one by one, only those that hold a wanted tensor."""

    def __init__(self, path: str, revision: str | None = None):
        self.path, self.revision, self.bytes_read = path, revision, 0
        # transformers' order: the one file first, then the index of shards
        if (single := self._file(SINGLE, optional=True)) is not None:
            with safe_open(single, framework="pt") as f:
                self.holder = {name: SINGLE for name in f.keys()}
        elif (index := self._file(INDEX, optional=True)) is not None:
            self.holder = json.loads(Path(index).read_text())["weight_map"]  # tensor name -> file name
        else:
            raise PartsUnreadable(f"{path} has no safetensors weights (e.g. only pytorch_model.bin)")
        local = Path(path).expanduser()
        self.total_bytes = (
            sum((local / f).stat().st_size for f in set(self.holder.values())) if local.is_dir() else None
        )

    def read(self, names) -> dict[str, Tensor]:
        missing = [n for n in names if n not in self.holder]
        if missing:
            raise PartsUnreadable(f"{self.path} holds no tensor named {', '.join(missing)}")
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.holder[name], []).append(name)
        out = {}
        for file, wanted in by_file.items():
            with safe_open(self._file(file), framework="pt") as f:
                for name in wanted:
                    out[name] = f.get_tensor(name)
                    self.bytes_read += out[name].nbytes
        return out

    def _file(self, name: str, optional: bool = False) -> str | None:
        return locate(self.path, name, self.revision, optional=optional)
