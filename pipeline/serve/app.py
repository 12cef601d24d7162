"""The Serve application: ``app_builder({"config": "jobs/configs/tiny.yaml"})`` -> Application (also
``serve run pipeline.serve.app:app_builder config=...``) of two deployments: ``Ingress``
(``pipeline.serve.ingress``: the HTTP edge, no model) in front of ``SpeculativeDecoder``
(``pipeline.serve.deployment``: the target + a GRIFFIN draft). ``pipeline.serve.lifecycle`` starts and stops
it (``start_serve``, ``stop_serve``, ``run_serve`` = ``griffin serve``). docs/serving.md is the user's guide.
"""

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray.serve import Application

from pipeline.config import RunConfig, config_from_dict, load_config
from pipeline.serve.auth import require_key
from pipeline.serve.deployment import SpeculativeDecoder, served_model_name
from pipeline.serve.ingress import EdgeConfig, Ingress

APP_NAME = "griffin"
# a redeploy replaces the ingress too (its arguments name the decoder): it waits this much longer than
# the decoders, so a stream whose decoder is force-killed at the end of its grace period still gets its
# error chunk and [DONE] before the ingress goes
RELAY_MARGIN_S = 10.0


class ServeArgs(BaseModel):
    """``app_builder`` arguments: a config file (+ ``section.field=value`` overrides) or a config dict."""

    model_config = ConfigDict(extra="forbid")
    config: str | None = None
    overrides: list[str] | str = Field(default_factory=list, description="a list, or one space-separated string")
    run_config: dict[str, Any] | None = None

    def load(self) -> RunConfig:
        if (self.config is None) == (self.run_config is None):
            raise ValueError("app_builder needs exactly one of 'config' (a YAML path) or 'run_config' (a dict)")
        if self.run_config is not None:
            return config_from_dict(self.run_config)
        overrides = self.overrides.split() if isinstance(self.overrides, str) else self.overrides
        return load_config(self.config, overrides)


def _portable(cfg: RunConfig) -> dict[str, Any]:
    """The config with local paths made absolute (replicas may start in another working directory) and
    the draft's registry alias pinned to its version (``pinned_draft``)."""
    data = cfg.resolved()
    data["output_dir"] = str(Path(cfg.output_dir).resolve())
    data["serve"]["draft_uri"] = pinned_draft(cfg)
    for section, key in (("serve", "draft_uri"), ("target", "name")):
        value = data[section][key]
        if value and Path(value).exists():
            data[section][key] = str(Path(value).resolve())
    return data


def pinned_draft(cfg: RunConfig) -> str | None:
    """``models:/NAME@ALIAS`` -> ``models:/NAME/<version>``, resolved once when the application is built:
    a replica that replaces a dead one loads the version its peers loaded, not whatever the alias names
    by then (moving ``champion`` reaches the endpoint with the next deploy)."""
    uri = cfg.serve.draft_uri
    if not (uri and uri.startswith("models:/") and "@" in uri):
        return uri
    from mlflow import MlflowClient

    from pipeline.runtime import setup_mlflow

    setup_mlflow(cfg)
    name, alias = uri.removeprefix("models:/").split("@", 1)
    return f"models:/{name}/{MlflowClient().get_model_version_by_alias(name, alias).version}"


def app_builder(args: dict[str, Any] | ServeArgs) -> Application:
    """The Serve application for a run config: ``Ingress`` calling ``SpeculativeDecoder`` (loads nothing here)."""
    cfg = (args if isinstance(args, ServeArgs) else ServeArgs(**args)).load()
    section = cfg.serve
    scaling = (
        {"autoscaling_config": section.autoscaling} if section.autoscaling else {"num_replicas": section.num_replicas}
    )
    _, most_replicas = section.decoder_replicas()
    slots = section.max_ongoing_requests * most_replicas  # completions at the decoders at once
    # Serve slots on either deployment: every completion the application admits (each ingress replica
    # may send all the slots, more than the slots when the queue is in use) plus the control slots
    room = slots + section.max_queued_requests + section.control_slots
    decoder = SpeculativeDecoder.options(
        # the ingress admits completions and Serve routes them (no queue bound here: the ingress's is
        # exact); room for all of them on one replica, so /health & co. never wait behind completions
        # however Serve spreads them
        max_ongoing_requests=room,
        max_queued_requests=-1,
        graceful_shutdown_timeout_s=section.graceful_shutdown_timeout_s,  # a going replica finishes its decodes
        ray_actor_options={"num_cpus": section.num_cpus, "num_gpus": section.num_gpus},
        **scaling,
    ).bind(_portable(cfg))
    edge = EdgeConfig(
        model_id=served_model_name(cfg),
        per_replica=section.max_ongoing_requests,
        most_replicas=most_replicas,
        queue=section.max_queued_requests,
        max_body_bytes=section.max_body_bytes,
        retry_after_s=section.retry_after_s,
        shed_status=section.shed_status,
        key_digest=require_key(section),  # refuses a host reachable from outside without a key
    )
    return Ingress.options(
        # serve.ingress_replicas, each admitting its share (pipeline.serve.ingress), with CPU of their own
        # so that decodes never starve the edge. Room for every admitted completion plus the control
        # slots (/health & co. and refusals, which answer at once): nothing waits in Serve's queue at
        # the proxy, so nothing is refused there (its bound misjudges bursts)
        num_replicas=section.ingress_replicas,
        max_ongoing_requests=room,
        max_queued_requests=-1,
        graceful_shutdown_timeout_s=section.graceful_shutdown_timeout_s + RELAY_MARGIN_S,  # ... and relays them
        ray_actor_options={"num_cpus": section.ingress_num_cpus},
    ).bind(decoder, edge)
