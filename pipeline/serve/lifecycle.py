"""Running the application: ``start_serve(cfg) -> url`` (on the configured Ray), ``stop_serve()``,
``ensure_serving(cfg)`` (start only when nothing answers) and ``run_serve(cfg)``, which is ``griffin serve``."""

from __future__ import annotations

import signal
import time
from typing import Any

from ray import serve

from pipeline.config import RunConfig
from pipeline.serve.app import APP_NAME, ServeArgs, app_builder
from pipeline.serve.auth import require_key
from pipeline.serve.deployment import served_model_name
from pipeline.serve.drain import drain, start_board


def serve_url(cfg: RunConfig) -> str:
    host = "127.0.0.1" if cfg.serve.host in ("0.0.0.0", "::") else cfg.serve.host
    return f"http://{host}:{cfg.serve.port}"


def start_serve(cfg: RunConfig) -> str:
    """Start (or update) the application on the configured Ray; returns its base URL once ready."""
    from pipeline.runtime import ensure_ray

    require_key(cfg.serve)  # before anything starts: a host reachable from outside needs a key
    ensure_ray(cfg)
    check_serve_fits(cfg)
    serve.start(
        http_options={"host": cfg.serve.host, "port": cfg.serve.port, "request_timeout_s": cfg.serve.request_timeout_s}
    )
    serve.run(app_builder(ServeArgs(run_config=cfg.resolved())), name=APP_NAME, route_prefix="/")
    return serve_url(cfg)


def check_serve_fits(cfg: RunConfig) -> None:
    """A local Ray cannot grow: refuse an application whose replicas it can never hold at once (Serve
    would wait for them without end), naming the settings. A cluster's autoscaler adds nodes instead."""
    from pipeline.runtime import cluster_address, describe_shortfall, resource_shortfall

    if cluster_address(cfg) is not None:
        return
    section = cfg.serve
    decoders, _ = section.decoder_replicas()  # those Serve starts at once
    needs = {
        "CPU": decoders * section.num_cpus + section.ingress_replicas * section.ingress_num_cpus,
        "GPU": decoders * section.num_gpus,
    }
    if short := resource_shortfall(needs):
        raise ValueError(
            "the local Ray cannot hold the application: "
            + describe_shortfall(short, "it")
            + f" ({decoders} decoder replica(s) x serve.num_cpus={section.num_cpus:g}, serve.num_gpus="
            f"{section.num_gpus:g}; serve.ingress_replicas={section.ingress_replicas} x serve.ingress_num_cpus="
            f"{section.ingress_num_cpus:g}). Lower them, or give the local Ray more (cluster.num_cpus)"
        )


def stop_serve() -> None:
    serve.shutdown()


def is_serving(url: str, timeout: float = 2.0) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def ensure_serving(cfg: RunConfig) -> tuple[str, bool]:
    """The endpoint's URL, starting Serve when nothing answers there; True when this call started it."""
    url = serve_url(cfg)
    return (url, False) if is_serving(url) else (start_serve(cfg), True)


class Terminated(Exception):
    """SIGTERM reached ``griffin serve`` (Kubernetes, systemd and ``kill`` stop a server with it)."""


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated


def run_serve(cfg: RunConfig) -> None:
    """``griffin serve``: start, print the URL, block until SIGTERM or Ctrl-C, then drain (every ingress
    replica: pipeline.serve.drain) and shut Serve down; a second signal during the drain stops at once."""
    from pipeline.runtime import ensure_ray

    require_key(cfg.serve)  # before anything starts
    ensure_ray(cfg)
    board = start_board()  # before the ingress replicas start: each finds it at its first look
    url = start_serve(cfg)
    what = f"draft {cfg.serve.draft_uri}" if cfg.serve.draft_uri else "vanilla decoding (no serve.draft_uri)"
    print(f"serving {served_model_name(cfg)} with {what} at {url}/v1 (Ctrl-C or SIGTERM to stop)", flush=True)
    signal.signal(signal.SIGTERM, _terminated)
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, Terminated):
        left = drain(board, cfg.serve.drain_s, cfg.serve.ingress_replicas)
        print("stopping" + (f" with {left} requests still running (serve.drain_s passed)" if left else ""), flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        stop_serve()
