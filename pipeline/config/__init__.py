"""The run config: one typed, frozen document per run, loaded from YAML with dotted overrides.

``load_config("jobs/configs/tiny.yaml", ["train.steps=10", "serve.port=8001"])`` -> RunConfig.
Unknown keys and bad values fail with a message that names the key and the allowed values.
Every stage records ``cfg.resolved()`` (the full config with defaults filled in) in its artifacts.
The sections live in ``sections``. Imports: griffin's configs and ``pipeline.runtime``'s URI
resolution only; every pipeline package may import this one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from griffin.config import SamplingConfig, TreeConfig
from pipeline.config.sections import (  # noqa: F401 (re-exported: pipeline.config names every section)
    Section,
    TargetSection,
    DataSection,
    RegenerateSection,
    FeaturesSection,
    DraftSection,
    StageSection,
    TrainSection,
    TrackingSection,
    RegistrySection,
    ServeSection,
    DecodeSection,
    EvalSection,
    ClusterSection,
    URI,
    local_path,
)
from pipeline.runtime import resolve_tracking


class RunConfig(Section):
    run_name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    output_dir: str = "outputs"
    target: TargetSection
    data: DataSection = Field(default_factory=DataSection)
    regenerate: RegenerateSection = Field(default_factory=RegenerateSection)
    features: FeaturesSection = Field(default_factory=FeaturesSection)
    draft: DraftSection = Field(default_factory=DraftSection)
    train: TrainSection = Field(default_factory=TrainSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    registry: RegistrySection = Field(default_factory=RegistrySection)
    decode: DecodeSection = Field(default_factory=DecodeSection)
    serve: ServeSection = Field(default_factory=ServeSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    cluster: ClusterSection = Field(default_factory=ClusterSection)

    _output_dir_is_local = field_validator("output_dir")(local_path)

    @model_validator(mode="after")
    def _check_eval_tree(self) -> "RunConfig":
        try:
            self.eval_tree  # eval.tree's fields on decode.tree must make a valid tree too
        except ValidationError as error:
            raise ValueError(f"eval.tree applied to decode.tree: {error.errors()[0]['msg']}") from None
        return self

    # ---- derived locations --------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name

    @property
    def store_path(self) -> str:
        return self.features.store or str(self.run_dir / "features")

    @property
    def regenerated_path(self) -> str:
        return self.regenerate.output or str(Path(self.output_dir) / f"{self.target_slug}-regenerated")

    @property
    def training_data(self) -> DataSection:
        """``data`` with ``source: regenerated`` resolved to the regenerated set's path, a local directory:
        ``data.revision`` then pinned the hub dataset of its prompts (``prompt_data``), not the set."""
        if self.data.source != "regenerated":
            return self.data
        return self.data.model_copy(update={"source": self.regenerated_path, "revision": None})

    @property
    def prompt_data(self) -> DataSection:
        """What ``griffin regenerate`` answers: ``data``'s reading settings on ``regenerate.source``."""
        limit = self.regenerate.limit or self.data.limit
        return self.data.model_copy(update={"source": self.regenerate.source, "limit": limit})

    @property
    def tracking_uri(self) -> str:
        uri = self.tracking.tracking_uri
        assert uri is not None, "load_config and config_from_dict fill it in (pipeline.runtime.resolve_tracking)"
        return uri

    @property
    def target_slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", Path(self.target.name).name.lower()).strip("-")

    @property
    def model_name(self) -> str:
        return self.registry.model_name or f"{self.target_slug}-{self.draft.variant}"

    @property
    def eval_tree(self) -> TreeConfig:
        """The tree evaluation decodes with: ``decode.tree`` with the fields ``eval.tree`` sets explicitly
        (``eval.tree.depth=3`` changes only the depth)."""
        if self.eval.tree is None:
            return self.decode.tree
        explicit = self.eval.tree.model_dump(include=self.eval.tree.model_fields_set)
        return TreeConfig(**{**self.decode.tree.model_dump(), **explicit})

    @property
    def speculation_policy(self) -> Any:
        """The serving engine's tree per batch size (griffin.policy.SpeculationPolicy): ``decode.policy``,
        with ``decode.tree`` below its smallest batch size (at every size without a policy), and for
        rounds whose drafting rows all sample ``decode.sampling_policy``, with ``decode.sampling_tree``
        (else ``decode.tree``) below its smallest size, or without one ``decode.sampling_tree``."""
        from griffin.policy import SpeculationPolicy, sampling_table

        decode = self.decode
        trees = {1: decode.tree, **(decode.policy or {})}
        if decode.sampling_policy is None:
            return SpeculationPolicy(trees, sampling_table(trees, decode.sampling_tree))
        return SpeculationPolicy(trees, {1: decode.sampling_tree or decode.tree, **decode.sampling_policy})

    def sampling(self, temperature: float) -> SamplingConfig:
        return SamplingConfig(temperature=temperature, top_p=self.eval.sampling_top_p if temperature > 0 else 1.0)

    def resolved(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def apply_override(data: dict[str, Any], dotted: str) -> None:
    if "=" not in dotted:
        raise ValueError(f"override {dotted!r} must look like section.field=value")
    key, value = dotted.split("=", 1)
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {part!r} is not a section")
    node[parts[-1]] = yaml.safe_load(value)  # a YAML scalar or list: 'true', '3', '1e-4', '[1, 2]', 'null'


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model in an annotation (``X``, ``X | None``, ``list[X]``), else None."""
    candidates = [annotation, *getattr(annotation, "__args__", ())]
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def _unknown_key(loc: tuple) -> str:
    """'unknown key' with the allowed keys, and where a subsection holds the key, e.g.
    ("train", "token_loss") -> "... did you mean 'train.method.token_loss'?"."""
    model: Any = RunConfig
    for part in (p for p in loc[:-1] if not isinstance(p, int)):  # a list item's model is the list's
        field = model.model_fields.get(part) if model else None
        model = _submodel(field.annotation) if field else None
    fields, where = (model.model_fields if model else {}), ".".join(str(p) for p in loc[:-1])
    homes = [name for name, f in fields.items() if (sub := _submodel(f.annotation)) and loc[-1] in sub.model_fields]
    hint = f"; did you mean {f'{where}.{homes[0]}.{loc[-1]}'!r}?" if homes else ""
    return f"unknown key {f'{where}.{loc[-1]}'.lstrip('.')!r} (allowed: {', '.join(fields)}){hint}"


def _explain(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "config"
        if item["type"] == "extra_forbidden":
            lines.append(_unknown_key(item["loc"]))
        else:
            lines.append(f"{where}: {item['msg'].removeprefix('Value error, ')}")
    return "; ".join(lines)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    try:
        # no environment here: a config dict sent to a Ray worker keeps the URIs the driver resolved
        return RunConfig(**resolve_tracking(data, environ={}))
    except ValidationError as error:
        raise ValueError(f"invalid run config: {_explain(error)}") from None


def merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``overlay`` on top of ``base``: mappings merge key by key, anything else (lists too) replaces.
    E.g. base {train: {batch_tokens: 2048, schedule: [a, b]}} + {train: {schedule: [c]}}
    -> {train: {batch_tokens: 2048, schedule: [c]}}."""
    merged = dict(base)
    for key, value in overlay.items():
        both_maps = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = merge(merged[key], value) if both_maps else value
    return merged


def read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """One config file with its ``extends:`` chain applied (a path relative to the file)."""
    path = path.resolve()
    if path in chain:
        raise ValueError(f"config {path} extends itself through {' -> '.join(str(p) for p in chain)}")
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} not found (see jobs/configs/ for examples)")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping of sections")
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ValueError(f"{path}: 'extends' must be one path to a base config, got {base!r}")
    return merge(read_yaml(path.parent / base, (*chain, path)), data)


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    data = read_yaml(Path(path))
    for item in overrides:
        apply_override(data, item)
    return config_from_dict(resolve_tracking(_absolute_paths(data)))  # MLFLOW_* env vars first


def _absolute_paths(data: dict[str, Any]) -> dict[str, Any]:
    """Relative local paths are relative to where the command runs; Ray workers, actors and Serve
    replicas run elsewhere, so the driver pins them to absolute paths once, here."""

    def pin(value: Any) -> Any:
        return str(Path(value).expanduser().resolve()) if isinstance(value, str) and not URI.match(value) else value

    data = {**data, "output_dir": pin(data.get("output_dir", "outputs"))}
    if isinstance(data.get("features"), dict) and data["features"].get("store"):
        data["features"] = {**data["features"], "store": pin(data["features"]["store"])}
    if isinstance(data.get("regenerate"), dict) and data["regenerate"].get("output"):
        data["regenerate"] = {**data["regenerate"], "output": pin(data["regenerate"]["output"])}
    return data
