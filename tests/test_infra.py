"""infra/ and the run configs: every manifest parses and agrees with the code and the GPU config.

Nothing here talks to a cluster. It checks what a typo or a drift between files would break on one:
KubeRay CRD shapes (ray.io/v1), every Ray pod and launcher node on the project's image (the tag named
once, in infra/image/IMAGE; the Dockerfile on the Ray of this venv), RayJob entrypoints naming real
``jobs/<stage>.py`` modules and config files, runtime_envs Ray accepts that install nothing, a Serve
config Ray's schema accepts whose import path builds the app, the launcher YAML against Ray's own
schema, the MLflow server (PostgreSQL, S3, ClusterIP only, no literal secrets), and every
jobs/configs/*.yaml.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import tomllib
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from pipeline.config import load_config

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
GPU_CONFIG = "jobs/configs/llama3-8b-gpu.yaml"
STAGES = ("featurize", "train", "register", "evaluate")
DRIVER_NEEDS_GPU = {"evaluate"}  # decodes in the driver; featurize and train drivers read no weights
IMAGE_DIR = INFRA / "image"
IMAGE = (IMAGE_DIR / "IMAGE").read_text().strip()  # the one place naming the tag; variants IMAGE-cpu, IMAGE-gpu
# runtime_env fields that install packages when a job starts: the image holds them instead
INSTALLING_FIELDS = {"pip", "uv", "conda", "py_modules", "py_executable", "image_uri", "container"}
# spec fields of the ray.io/v1 CRDs (KubeRay API reference): a misspelt key is silently dropped by
# the API server, so it has to be caught here
CRD_SPEC_FIELDS = {
    "RayCluster": {
        "suspend",
        "managedBy",
        "autoscalerOptions",
        "headServiceAnnotations",
        "enableInTreeAutoscaling",
        "gcsFaultToleranceOptions",
        "headGroupSpec",
        "rayVersion",
        "workerGroupSpecs",
        "authOptions",
        "upgradeStrategy",
    },
    "RayJob": {
        "activeDeadlineSeconds",
        "backoffLimit",
        "rayClusterSpec",
        "submitterPodTemplate",
        "metadata",
        "clusterSelector",
        "submitterConfig",
        "managedBy",
        "deletionStrategy",
        "entrypoint",
        "runtimeEnvYAML",
        "jobId",
        "submissionMode",
        "entrypointResources",
        "entrypointNumCpus",
        "entrypointNumGpus",
        "ttlSecondsAfterFinished",
        "shutdownAfterJobFinishes",
        "suspend",
    },
    "RayService": {
        "serveService",
        "upgradeStrategy",
        "serveConfigV2",
        "rayClusterConfig",
        "excludeHeadPodFromServeSvc",
    },
}
WORKER_GROUP_FIELDS = {
    "groupName",
    "replicas",
    "minReplicas",
    "maxReplicas",
    "rayStartParams",
    "template",
    "scaleStrategy",
    "suspend",
    "idleTimeoutSeconds",
    "numOfHosts",
    "headService",
}
SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET|ACCESS_KEY|API_KEY|CREDENTIAL", re.I)


# ---- loading ----------------------------------------------------------------------------------
def _infra_files() -> list[Path]:
    return sorted(p for p in INFRA.rglob("*") if p.suffix in (".yaml", ".yml"))


def _load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@pytest.fixture(scope="module")
def docs() -> dict[str, list[dict]]:
    return {str(p.relative_to(INFRA)): _load(p) for p in _infra_files()}


@pytest.fixture(scope="module")
def manifests(docs) -> list[dict]:
    return [d for name, items in docs.items() if not name.startswith("cluster-launcher/") for d in items]


@pytest.fixture(scope="module")
def cfg():
    return load_config(REPO / GPU_CONFIG)


def _kind(manifests, kind: str) -> list[dict]:
    return [m for m in manifests if m.get("kind") == kind]


def _one(manifests, kind: str, name: str) -> dict:
    found = [m for m in _kind(manifests, kind) if m["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} named {name}, found {len(found)}"
    return found[0]


def _containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def _pod_specs(manifest: dict) -> list[dict]:
    """Every pod spec a manifest creates (Deployments, StatefulSets, Ray groups)."""
    spec = manifest.get("spec") or {}
    cluster = spec.get("rayClusterConfig") or spec.get("rayClusterSpec") or (spec if "headGroupSpec" in spec else None)
    if cluster:
        groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
        return [g["template"]["spec"] for g in groups]
    if "template" in spec:
        return [spec["template"]["spec"]]
    return []


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _dockerfile() -> dict:
    """infra/image/Dockerfile's instructions: the ARG defaults, FROM, WORKDIR, COPY sources and RUN lines."""
    text = re.sub(r"\\\n\s*", " ", (IMAGE_DIR / "Dockerfile").read_text())  # join continued lines
    found: dict = {"args": {}, "from": [], "copy": [], "run": [], "workdir": None}
    for line in (ln.strip() for ln in text.splitlines()):
        word, _, rest = line.partition(" ")
        if word == "ARG":
            name, _, default = rest.partition("=")
            found["args"].setdefault(name, default or None)  # the global default, not the stage's re-declaration
        elif word == "FROM":
            found["from"].append(rest)
        elif word == "WORKDIR":
            found["workdir"] = rest
        elif word == "COPY":
            found["copy"] += [a for a in shlex.split(rest) if not a.startswith("--")][:-1]
        elif word == "RUN":
            found["run"].append(rest)
    return found


# ---- every file -------------------------------------------------------------------------------
def test_infra_has_every_piece():
    names = {str(p.relative_to(INFRA)) for p in _infra_files()}
    expected = {
        "kuberay/raycluster.yaml",
        "kuberay/rayservice.yaml",
        "cluster-launcher/aws.yaml",
        *(f"kuberay/rayjob-{stage}.yaml" for stage in STAGES),
    }
    assert expected <= names, f"missing: {sorted(expected - names)}"
    assert any(n.startswith("mlflow/") for n in names)
    assert (INFRA / "README.md").is_file()


@pytest.mark.parametrize("path", _infra_files(), ids=lambda p: str(p.relative_to(INFRA)))
def test_every_yaml_parses_into_mappings(path):
    items = _load(path)
    assert items, f"{path} holds no document"
    for doc in items:
        assert isinstance(doc, dict), f"{path}: a document is a {type(doc).__name__}, not a mapping"
        if path.parent.name != "cluster-launcher":
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), f"{path}: not a Kubernetes object"


def test_kuberay_objects_are_ray_io_v1_with_known_fields(manifests):
    import ray

    ray_objects = [m for m in manifests if m["apiVersion"].startswith("ray.io")]
    assert {m["kind"] for m in ray_objects} == {"RayCluster", "RayJob", "RayService"}
    for m in ray_objects:
        assert m["apiVersion"] == "ray.io/v1", f"{m['kind']} {m['metadata']['name']}: {m['apiVersion']}"
        unknown = set(m["spec"]) - CRD_SPEC_FIELDS[m["kind"]]
        assert not unknown, f"{m['kind']} {m['metadata']['name']}: unknown spec fields {sorted(unknown)}"
        assert m["spec"].get("rayVersion", ray.__version__) == ray.__version__
        for pod in _pod_specs(m):
            for c in _containers({"spec": pod}):
                assert c["image"] in (f"{IMAGE}-cpu", f"{IMAGE}-gpu"), f"{m['metadata']['name']}: {c['image']}"


# ---- the image ------------------------------------------------------------------------------------
def test_image_is_ray_of_this_venv_with_the_project_installed_from_constraints():
    import ray

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    repository, tag = IMAGE.rsplit(":", 1)
    assert repository.endswith("/" + project["name"]) and tag == project["version"], f"{IMAGE} != the project"
    image = _dockerfile()
    assert image["from"] == ["${BASE}"], "one build stage, from the pinned base"
    variant = image["args"]["VARIANT"]
    base = image["args"]["BASE"].replace("${VARIANT}", variant)
    assert variant == "gpu" and base == f"rayproject/ray:{ray.__version__}-py311-gpu", base
    assert "VARIANT" in image["run"][0] and "download.pytorch.org/whl/cpu" in image["run"][0]  # the cpu variant
    assert {"pyproject.toml", "constraints.txt", "griffin/", "pipeline/", "jobs/"} <= set(image["copy"])
    (install,) = [shlex.split(c) for run in image["run"] for c in run.split("&&") if "pip install" in c]
    assert install[install.index("-c") + 1] == "constraints.txt" and install[-1] == ".", install
    assert any("pip check" in run for run in image["run"]), "a conflict with the base must fail the build"
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in ignore and set(image["copy"]) <= {ln[1:] for ln in ignore if ln.startswith("!")}, "context"


# ---- RayCluster -------------------------------------------------------------------------------
def _check_ray_cluster(name: str, cluster: dict, manifests) -> dict:
    """Head without GPUs + a GPU worker group; the shared PVC on every pod. Returns the GPU group."""
    import ray

    assert cluster["rayVersion"] == ray.__version__
    head = cluster["headGroupSpec"]
    head_container = _containers(head["template"])[0]
    assert head_container["image"] == f"{IMAGE}-cpu", f"{name}: the head should be the CPU image"
    assert "nvidia.com/gpu" not in head_container["resources"].get("limits", {})
    assert head.get("serviceType", "ClusterIP") == "ClusterIP", f"{name}: the head service must stay in the cluster"
    gpu_groups = [
        g
        for g in cluster["workerGroupSpecs"]
        if int(_containers(g["template"])[0]["resources"]["limits"].get("nvidia.com/gpu", 0)) > 0
    ]
    assert gpu_groups, f"{name}: no worker group requests nvidia.com/gpu"
    for group in cluster["workerGroupSpecs"]:
        assert set(group) <= WORKER_GROUP_FIELDS, f"{name}: unknown group fields {set(group) - WORKER_GROUP_FIELDS}"
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
    for group in gpu_groups:
        container = _containers(group["template"])[0]
        assert container["image"] == f"{IMAGE}-gpu", f"{name}: GPU workers need the -gpu image"
        assert (
            container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
        )
    claims = {pvc["metadata"]["name"] for pvc in _kind(manifests, "PersistentVolumeClaim")}
    for pod in _pod_specs({"spec": cluster}):
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0].get("volumeMounts", [])}
        assert "/mnt/griffin" in mounts, f"{name}: a pod lacks the shared volume at /mnt/griffin"
        claim = volumes[mounts["/mnt/griffin"]]["persistentVolumeClaim"]["claimName"]
        assert claim in claims, f"{name}: PVC {claim} is defined nowhere in infra/"
    pvc = next(p for p in _kind(manifests, "PersistentVolumeClaim"))
    assert "ReadWriteMany" in pvc["spec"]["accessModes"], "the shared volume must be mountable by every pod"
    return gpu_groups[0]


def test_raycluster_cpu_head_and_gpu_workers_fit_the_config(manifests, cfg):
    cluster = _one(manifests, "RayCluster", "griffin")
    spec = cluster["spec"]
    gpu_group = _check_ray_cluster("RayCluster griffin", spec, manifests)
    assert spec["enableInTreeAutoscaling"] is True and gpu_group["minReplicas"] == 0  # GPUs scale to zero
    assert spec["headGroupSpec"]["rayStartParams"].get("num-cpus") == "0"
    per_pod = int(_containers(gpu_group["template"])[0]["resources"]["limits"]["nvidia.com/gpu"])
    gpus_needed = max(
        cfg.features.num_actors * cfg.features.gpus_per_actor, cfg.train.num_workers if cfg.train.use_gpu else 0
    )  # the featurize and train drivers hold none (the evaluation driver's one runs alone)
    assert gpu_group["maxReplicas"] * per_pod >= gpus_needed, "the GPU group can't hold the actors"
    cpus = float(_containers(gpu_group["template"])[0]["resources"]["limits"]["cpu"])
    assert cfg.train.cpus_per_worker < cpus and cfg.features.cpus_per_actor < cpus  # room for Ray Data tasks


# ---- RayJobs ----------------------------------------------------------------------------------
def _runtime_env(text: str) -> dict:
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load(text)
    RuntimeEnv(**env)  # Ray's own validation of every field
    return env


@pytest.mark.parametrize("stage", STAGES)
def test_rayjob_runs_a_real_stage_module_with_a_real_config(stage, docs, manifests, cfg):
    (job,) = docs[f"kuberay/rayjob-{stage}.yaml"]
    assert job["kind"] == "RayJob"
    spec = job["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["python", "-m"] and argv[3] == "-c", spec["entrypoint"]
    module, config = argv[2], argv[4]
    assert module == f"jobs.{stage}" and (REPO / (module.replace(".", "/") + ".py")).is_file()
    assert (REPO / config).is_file(), f"{config} does not exist"
    load_config(REPO / config, argv[5:])
    # one approach for all: the long-lived RayCluster, never a cluster of its own
    assert "rayClusterSpec" not in spec
    assert spec["clusterSelector"] == {"ray.io/cluster": _one(manifests, "RayCluster", "griffin")["metadata"]["name"]}
    assert spec.get("shutdownAfterJobFinishes", False) is False
    if stage in DRIVER_NEEDS_GPU and cfg.target.device.startswith("cuda"):
        assert spec.get("entrypointNumGpus", 0) >= 1, f"the {stage} driver loads the target on CUDA"
    else:
        assert spec.get("entrypointNumGpus", 0) == 0
    env = _runtime_env(spec["runtimeEnvYAML"])
    assert env["working_dir"] == f"local://{_dockerfile()['workdir']}", "the job runs the image's own copy"


def _all_runtime_envs(docs) -> dict[str, dict]:
    envs = {f"rayjob-{s}": _runtime_env(docs[f"kuberay/rayjob-{s}.yaml"][0]["spec"]["runtimeEnvYAML"]) for s in STAGES}
    serve = yaml.safe_load(docs["kuberay/rayservice.yaml"][0]["spec"]["serveConfigV2"])
    for app in serve["applications"]:
        envs[f"rayservice/{app['name']}"] = _runtime_env(yaml.safe_dump(app["runtime_env"]))
    return envs


def test_no_runtime_env_installs_packages(docs, cfg):
    config_env = cfg.cluster.runtime_env
    assert not INSTALLING_FIELDS & config_env.keys(), f"{GPU_CONFIG}: the image holds the packages"
    for where, env in _all_runtime_envs(docs).items():
        assert not INSTALLING_FIELDS & env.keys(), f"{where}: installs {sorted(INSTALLING_FIELDS & env.keys())}"
        missing = {k: v for k, v in config_env["env_vars"].items() if env["env_vars"].get(k) != v}
        assert not missing, f"{where}: env_vars lack {missing}"
    # ensure_ray passes cluster.runtime_env to ray.init inside the job: Ray must be told to merge
    assert config_env["env_vars"].get("RAY_OVERRIDE_JOB_RUNTIME_ENV") == "1"


def test_gpu_config_puts_every_path_on_the_shared_volume(cfg):
    shared = "/mnt/griffin/"
    paths = [
        cfg.output_dir,
        cfg.store_path,
        cfg.data.source,
        *cfg.eval.datasets,
        *cfg.cluster.runtime_env["env_vars"].values(),
    ]
    local = [p for p in paths if p.startswith("/") and not p.startswith(shared)]
    assert not local and cfg.output_dir.startswith(shared) and cfg.store_path.startswith(shared), local
    assert cfg.target.device == "cuda" and cfg.train.use_gpu and cfg.features.gpus_per_actor >= 1
    assert cfg.cluster.python == "python", "submitted jobs must not use the submitter's interpreter path"
    assert urlparse(cfg.tracking_uri).scheme in ("http", "https")


# ---- RayService -------------------------------------------------------------------------------
def test_rayservice_builds_the_decoder_app(docs, manifests, cfg, monkeypatch):
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    (service,) = docs["kuberay/rayservice.yaml"]
    assert service["kind"] == "RayService"
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema(**config)  # what the Serve controller accepts
    (app,) = config["applications"]
    module_name, attr = app["import_path"].split(":")
    builder = getattr(importlib.import_module(module_name), attr)
    assert builder is importlib.import_module("pipeline.serve.app").app_builder
    # the args load the config and nothing runs. Building pins a registry alias to its version (a
    # lookup in the cluster's MLflow, tests/pipeline/test_registry.py), so here the draft is a directory
    assert load_config(app["args"]["config"], app["args"]["overrides"]).serve.draft_uri.startswith("models:/")
    local = {
        **app["args"],
        "overrides": [*app["args"]["overrides"], f"serve.draft_uri={REPO / 'drafts/smollm2-135m-instruct/griffin'}"],
    }
    args_cfg = load_config(REPO / app["args"]["config"], app["args"].get("overrides", []))
    # http_options bind 0.0.0.0: without the API key the builder refuses; every pod has it from a Secret
    key_env = args_cfg.serve.api_key_env
    monkeypatch.delenv(key_env, raising=False)
    with pytest.raises(ValueError, match="no API key is set"):
        builder(local)
    for pod in _pod_specs(service):
        for container in pod["containers"]:
            assert _env(container)[key_env]["valueFrom"]["secretKeyRef"]["name"] == "griffin-api-key"
    monkeypatch.setenv(key_env, "sk-test")
    assert isinstance(builder(local), serve.Application)
    assert config["http_options"]["port"] == args_cfg.serve.port
    assert config["http_options"]["host"] == "0.0.0.0"  # inside the pod; exposed by the ClusterIP serve service
    gpu_group = _check_ray_cluster("RayService", service["spec"]["rayClusterConfig"], manifests)
    limits = _containers(gpu_group["template"])[0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) >= args_cfg.serve.num_gpus and float(limits["cpu"]) >= args_cfg.serve.num_cpus
    max_replicas = (args_cfg.serve.autoscaling or {}).get("max_replicas", args_cfg.serve.num_replicas)
    assert gpu_group["maxReplicas"] >= max_replicas, "the GPU group can't hold serve's max replicas"


# ---- cluster launcher ---------------------------------------------------------------------------
def test_launcher_yaml_matches_rays_schema(docs):
    import jsonschema

    (launcher,) = docs["cluster-launcher/aws.yaml"]
    schema = json.loads(
        (Path(importlib.import_module("ray.autoscaler").__file__).parent / "ray-schema.json").read_text()
    )
    jsonschema.validate(launcher, schema)
    types = launcher["available_node_types"]
    assert launcher["head_node_type"] in types
    assert launcher["provider"]["type"] == "aws"
    docker = launcher["docker"]
    assert docker["head_image"] == f"{IMAGE}-cpu" and docker["image"] == docker["worker_image"] == f"{IMAGE}-gpu"
    workers = [t for name, t in types.items() if name != launcher["head_node_type"]]
    assert workers and all(t.get("max_workers", 0) >= 1 for t in workers)
    commands = [c for key, value in launcher.items() if key.endswith("_commands") for c in value]
    assert not [c for c in commands if re.search(r"\b(pip|uv|conda)\b.*\binstall\b", c)], "the image holds them"
    # the image's copy of the project is the code (~/griffin); a copy of the local checkout would shadow it
    assert "." not in launcher["file_mounts"].values() and "~/griffin" not in launcher["file_mounts"]
    assert "-v /mnt/griffin:/mnt/griffin" in docker["run_options"], "the shared filesystem must reach the containers"


# ---- MLflow -----------------------------------------------------------------------------------
def _resolve(value: str, container: dict, manifests) -> str:
    """Expand Kubernetes $(VAR) references from literal and ConfigMap env; secrets stay references."""

    def sub(match):
        entry = _env(container)[match[1]]
        if "value" in entry:
            return entry["value"]
        ref = entry["valueFrom"].get("configMapKeyRef")
        if ref:
            return _one(manifests, "ConfigMap", ref["name"])["data"][ref["key"]]
        return match[0]  # a secret: left as $(VAR)

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


def test_mlflow_server_postgres_s3_cluster_internal(docs, manifests, cfg):
    mlflow_docs = [d for name, items in docs.items() if name.startswith("mlflow/") for d in items]
    servers = [
        (d, c)
        for d in _kind(mlflow_docs, "Deployment")
        for c in _containers(d["spec"]["template"])
        if " ".join(c.get("command", []) + c.get("args", [])).startswith("mlflow server")
    ]
    assert len(servers) == 1, "expected one Deployment running `mlflow server`"
    deployment, container = servers[0]
    argv = [_resolve(a, container, manifests) for a in container.get("command", []) + container["args"]]
    option = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert option["--host"] == "0.0.0.0"
    store = urlparse(option["--backend-store-uri"])
    assert store.scheme.startswith("postgresql"), option["--backend-store-uri"]
    assert re.fullmatch(r"\$\([A-Z_]+\)", store.password or ""), "the DB password must come from a Secret"
    secret_var = store.password[2:-1]
    assert "secretKeyRef" in _env(container)[secret_var]["valueFrom"]
    assert option["--artifacts-destination"].startswith("s3://") and "--serve-artifacts" in argv
    # reachable from the Ray pods under the config's host name, and from nowhere outside the cluster
    tracking = urlparse(cfg.tracking_uri)
    assert tracking.netloc in option["--allowed-hosts"].split(","), "MLflow would reject the Ray pods' Host header"
    service_name, namespace = tracking.hostname.split(".")[:2]
    service = _one(mlflow_docs, "Service", service_name)
    assert service["metadata"]["namespace"] == namespace == deployment["metadata"]["namespace"]
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == (tracking.port or 80)]
    assert port["targetPort"] in {p.get("name") for p in container["ports"]} | {
        p["containerPort"] for p in container["ports"]
    }
    assert int(option["--port"]) in {p["containerPort"] for p in container["ports"]}
    for svc in _kind(mlflow_docs, "Service"):
        assert svc["spec"].get("type", "ClusterIP") == "ClusterIP", f"{svc['metadata']['name']} leaves the cluster"
    postgres = [
        c
        for d in _kind(mlflow_docs, "StatefulSet")
        for c in _containers(d["spec"]["template"])
        if c["image"].startswith("postgres")
    ]
    assert postgres and "secretKeyRef" in _env(postgres[0])["POSTGRES_PASSWORD"]["valueFrom"]


def test_no_literal_secrets_anywhere(manifests):
    assert not [m for m in _kind(manifests, "Secret") if m.get("data") or m.get("stringData")], (
        "Secrets are created by hand (infra/README.md), never committed"
    )
    for m in manifests:
        for pod in _pod_specs(m):
            for c in pod.get("initContainers", []) + pod["containers"]:
                for name, entry in _env(c).items():
                    if SECRET_NAME.search(name):
                        assert "secretKeyRef" in entry.get("valueFrom", {}), (
                            f"{m['metadata']['name']}: {name} is literal"
                        )
                for arg in c.get("args", []) + c.get("command", []):
                    assert not re.search(r"://[^/\s$]+:[^@\s$]+@", arg), f"credentials in {arg!r}"


# ---- run configs ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted((REPO / "jobs" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_run_config_validates(path):
    cfg = load_config(path)
    assert cfg.run_name and cfg.train.schedule
