"""pipeline.registry on a real MLflow: sqlite in tmp_path, and one real ``mlflow server``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from mlflow.exceptions import MlflowException

from griffin.model import GriffinDraft
from griffin.checkpoint import save_draft
from pipeline.registry import register as registry
from pipeline.config import load_config
from pipeline.resources import drafts
from pipeline.resources.identity import target_fingerprint
from pipeline.resources.targets import load_target
from pipeline.resources.targets import build_tiny_target
from tests.conftest import free_port, make_target

STARTUP_S = 180  # the MLflow server's start-up allowance


def make_cfg(output_dir, *overrides):
    return load_config("jobs/configs/tiny.yaml", [f"output_dir={output_dir}", *overrides])


def make_draft(cfg, target, path, seed=0, train_run_id="not-in-this-store"):
    """A randomly initialised draft with the provenance training writes."""
    torch.manual_seed(seed)
    draft = GriffinDraft.for_target(target)
    provenance = {
        "variant": "griffin",
        "stage": 2,
        "target": target_fingerprint(target),
        "feature_manifest_sha256": "f" * 64,
        "resolved_config": cfg.resolved(),
        "train_run_id": train_run_id,
        "metrics": {"eval/sim_accept_len": 1.75},
    }
    save_draft(draft, path, provenance)
    return draft


def downloads(cfg):
    """The registry downloads left under the outputs (``resolve_draft`` keeps its own)."""
    cache = Path(cfg.output_dir) / "draft-cache"
    return set(cache.iterdir()) if cache.is_dir() else set()


def greedy_texts(cfg, draft_dir, prompts, max_new_tokens):
    """What the registered pyfunc must return at T=0, decoded here in this process: each prompt as one
    user turn through the target's chat template (``render_chat``), the target's greedy continuation
    (``vanilla_generate``), which the draft decoding speculatively with the config's tree reproduces
    token for token (``speculative_generate``: lossless), as text cut like the server's
    (``completion_text``). The target is built from ``cfg.target`` for decoding and the draft is loaded
    from ``draft_dir`` bound to it, as ``pipeline/serve/pyfunc.py`` builds them from the model config."""
    from griffin.config import SamplingConfig
    from griffin.decode import speculative_generate, vanilla_generate
    from pipeline.data.chat import render_chat
    from pipeline.serve.protocol import completion_text

    target = load_target(cfg.target, decoding=True)
    draft = drafts.load_draft_uri(draft_dir, target, cfg)
    greedy, texts = SamplingConfig(temperature=0.0), []
    for prompt in prompts:
        ids = torch.tensor([render_chat(target.tokenizer, [{"role": "user", "content": prompt}])], device=target.device)
        tokens = vanilla_generate(target, ids, greedy, max_new_tokens).tokens
        speculative = speculative_generate(target, draft, ids, cfg.decode.tree, greedy, max_new_tokens).tokens
        assert speculative == tokens, (prompt, speculative, tokens)
        texts.append(completion_text(target.tokenizer, tokens, target.stop_token_ids, [])[0])
    return texts


def logits(draft):
    torch.manual_seed(1)
    prediction, _ = draft([torch.randn(1, 5, draft.cfg.hidden_size)], torch.randint(0, 200, (1, 5)))
    return draft.logits(prediction)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module (creating one costs seconds); tests use their own model name."""
    return tmp_path_factory.mktemp("mlflow")


@pytest.fixture(scope="module")
def target():
    return load_target(make_cfg("unused").target)


def test_register_alias_load(store, target, tmp_path):
    """register -> alias candidate -> load by alias / version / run gives identical logits; the pyfunc
    loaded by alias returns, at T=0, the non-empty text decoded here in-process (``greedy_texts``)."""
    cfg = make_cfg(store, "registry.model_name=load-test")
    draft = make_draft(cfg, target, tmp_path / "d")
    (tmp_path / "d" / "train_state.pt").write_bytes(b"optimizer state: not part of the model")
    info = registry.register(cfg, tmp_path / "d")
    assert info["created"] and info["version"] == 1 and info["aliases"] == ["candidate"]
    resolved = drafts.resolve_draft("models:/load-test@candidate", cfg)
    assert sorted(p.name for p in resolved.iterdir()) == ["config.json", "model.safetensors"]
    kept = downloads(cfg)
    assert any(resolved.is_relative_to(folder) for folder in kept)
    for uri in ("models:/load-test@candidate", "models:/load-test/1", f"runs:/{info['run_id']}/draft"):
        loaded = drafts.load_draft_uri(uri, target, cfg)
        assert torch.equal(logits(loaded), logits(draft)), uri
        assert downloads(cfg) == kept  # a loaded draft's download is removed (replicas load one each start)
    import mlflow
    import pandas as pd

    # its text is the target's greedy text for the prompt (out of the process: tests/pipeline/test_mlflow.py)
    pyfunc = mlflow.pyfunc.load_model("models:/load-test@candidate")
    expected = greedy_texts(cfg, tmp_path / "d", ["hi", "2+2="], 4)
    for given in (pd.DataFrame({"prompt": ["hi", "2+2="]}), {"prompt": ["hi", "2+2="]}):  # a frame, or a list in a dict
        texts = pyfunc.predict(given, params={"max_new_tokens": 4, "temperature": 0.0})
        assert list(texts) == expected and all(texts), texts


def test_the_pyfunc_samples_with_the_sampling_tree(store, target, tmp_path, monkeypatch):
    """A version registered with ``decode.sampling_tree`` drafts that tree at T > 0 and ``decode.tree`` at
    T=0 (a replica's rule), and its seeded T=1 text is the target's own seeded text. Its target is capped
    at the registered ``decode.max_context`` (a decode's KV is sized to it), or at load's ``max_context``."""
    import mlflow

    import griffin.decode

    from griffin.config import SamplingConfig, TreeConfig
    from griffin.decode import vanilla_generate
    from pipeline.data.chat import render_chat
    from pipeline.serve.protocol import completion_text

    cfg = make_cfg(
        store,
        "registry.model_name=sampling-tree",
        "decode.sampling_tree={total_tokens: 4, depth: 1, top_k: 3}",
        "decode.max_context=64",
    )
    make_draft(cfg, target, tmp_path / "d")
    registry.register(cfg, tmp_path / "d")
    pyfunc = mlflow.pyfunc.load_model("models:/sampling-tree@candidate")
    assert pyfunc.unwrap_python_model().target.max_context == 64
    capped = mlflow.pyfunc.load_model("models:/sampling-tree@candidate", model_config={"max_context": 32})
    assert capped.unwrap_python_model().target.max_context == 32
    trees, generate = [], griffin.decode.speculative_generate  # predict imports it when it runs
    monkeypatch.setattr(griffin.decode, "speculative_generate", lambda *a: trees.append(a[3]) or generate(*a))
    pyfunc.predict({"prompt": ["hi"]}, params={"max_new_tokens": 2, "temperature": 0.0})
    (text,) = pyfunc.predict({"prompt": ["hi"]}, params={"max_new_tokens": 6, "temperature": 1.0, "seed": 7})
    assert trees == [cfg.decode.tree, TreeConfig(total_tokens=4, depth=1, top_k=3)]
    decoding = load_target(cfg.target, decoding=True)
    ids = torch.tensor([render_chat(decoding.tokenizer, [{"role": "user", "content": "hi"}])])
    tokens = vanilla_generate(decoding, ids, SamplingConfig(temperature=1.0), 6, 7).tokens
    assert text == completion_text(decoding.tokenizer, tokens, decoding.stop_token_ids, [])[0]


def test_lineage_tags(store, target, tmp_path):
    cfg = make_cfg(store, "registry.model_name=lineage-test")
    make_draft(cfg, target, tmp_path / "d")
    tags = registry.register(cfg, tmp_path / "d")["tags"]
    fingerprint = target_fingerprint(target)
    assert tags["target.target_id"] == "tiny-llama"
    assert tags["target.target_weights_sha256"] == fingerprint["target_weights_sha256"]
    assert tags["target.tokenizer_sha256"] == fingerprint["tokenizer_sha256"]
    assert tags["target.chat_template_sha256"] == fingerprint["chat_template_sha256"]
    assert tags["feature_manifest_sha256"] == "f" * 64
    assert (tags["variant"], tags["stage"], tags["draft_vocab_size"]) == ("griffin", "2", str(target.vocab_size))
    assert tags["weights_sha256"] == registry.weights_sha256(tmp_path / "d")
    assert '"run_name": "tiny"' in tags["resolved_config"]


def test_register_twice_is_idempotent(store, target, tmp_path):
    """Same weights -> the same version (created False); new weights -> a new version."""
    cfg = make_cfg(store, "registry.model_name=idem-test")
    make_draft(cfg, target, tmp_path / "a")
    make_draft(cfg, target, tmp_path / "a-copy")  # same seed: same weights, another directory
    make_draft(cfg, target, tmp_path / "b", seed=1)
    first = registry.register(cfg, tmp_path / "a")
    second = registry.register(cfg, tmp_path / "b")
    again = registry.register(cfg, tmp_path / "a-copy")
    assert (first["version"], second["version"], again["version"]) == (1, 2, 1)
    assert first["created"] and not again["created"] and again["aliases"] == ["candidate"]
    from mlflow import MlflowClient

    assert len(MlflowClient().search_model_versions("name = 'idem-test'")) == 2


def test_logged_in_training_run(store, target, tmp_path):
    """A draft whose training run is in this store is logged inside that run."""
    cfg = make_cfg(store, "registry.model_name=run-test")
    import mlflow

    registry.setup_mlflow(cfg)
    with mlflow.start_run(run_name="train") as run:
        pass
    make_draft(cfg, target, tmp_path / "d", train_run_id=run.info.run_id)
    assert registry.register(cfg, tmp_path / "d")["run_id"] == run.info.run_id


def test_promotion_gate(store, target, tmp_path):
    """champion moves only when τ beats the champion's τ on the same benchmark."""
    cfg = make_cfg(store, "registry.model_name=promo-test")
    for seed in range(3):
        make_draft(cfg, target, tmp_path / f"d{seed}", seed=seed)
        registry.register(cfg, tmp_path / f"d{seed}")
    assert not registry.run_register(cfg, tmp_path / "d0", promote=True)["promotion"]["promoted"]  # no τ yet
    from mlflow import MlflowClient

    client = MlflowClient()
    registry.record_evaluation(client, "promo-test", "1", {"eval.mt_bench.T0.tau": 2.0}, 0)  # as `griffin eval` does
    assert registry.run_register(cfg, tmp_path / "d0", promote=True)["promotion"]["promoted"]
    refused = registry.promote(cfg, 2, 1.9)
    assert not refused["promoted"] and "does not beat" in refused["reason"]
    assert not registry.promote(cfg, 2, 2.0)["promoted"]  # a tie is not a win
    assert not registry.promote(cfg, 3, 9.0, benchmark="humaneval")["promoted"]  # champion has no τ there
    assert registry.promote(cfg, 3, 2.5)["promoted"]
    assert int(client.get_model_version_by_alias("promo-test", "champion").version) == 3
    assert client.get_model_version("promo-test", "2").tags["tau.mt_bench"] == "2.0"
    with pytest.raises(ValueError, match="acceptance length"):
        registry.promote(cfg, 3, 0.5)
    registry.record_evaluation(client, "promo-test", "2", {"eval.mt_bench.T0.tau": 5.0}, 1)  # as `griffin eval` does
    blocked = registry.promote(cfg, 2, 5.0)
    assert not blocked["promoted"] and "beyond a bf16 near-tie" in blocked["reason"]
    assert not registry.promote(cfg, 2)["promoted"]  # the evaluation's own τ meets its own violations


def test_an_evaluation_cut_between_tau_and_violations_promotes_nothing(store, target, tmp_path):
    """An evaluation that died after writing τ but before its violations leaves τ tags without the
    gate record; promotion refuses instead of reading "no violations" from the missing tag. A finished
    evaluation's record carries both, so re-measuring fixes it."""
    cfg = make_cfg(store, "registry.model_name=cut-test")
    make_draft(cfg, target, tmp_path / "d")
    registry.register(cfg, tmp_path / "d")
    from mlflow import MlflowClient

    client = MlflowClient()
    client.set_model_version_tag("cut-test", "1", "eval.mt_bench.T0.tau", "3.0")  # what got written before the crash
    refused = registry.promote(cfg, 1)
    assert not refused["promoted"] and "rerun `griffin eval`" in refused["reason"], refused
    with pytest.raises(MlflowException):
        client.get_model_version_by_alias("cut-test", "champion")

    registry.record_evaluation(client, "cut-test", "1", {"eval.mt_bench.T0.tau": 3.0}, 2)  # the rerun found 2
    blocked = registry.promote(cfg, 1)
    assert not blocked["promoted"] and "decoded 2 T=0 generations" in blocked["reason"], blocked
    registry.record_evaluation(client, "cut-test", "1", {"eval.mt_bench.T0.tau": 3.0}, 0)
    assert registry.promote(cfg, 1)["promoted"]
    assert client.get_model_version("cut-test", "1").tags["eval.violations"] == "0"  # loose copies for people


def test_served_alias_is_pinned_to_its_version_when_the_app_is_built(store, target, tmp_path):
    """Every replica of one deployment, a replacement for a dead one included, loads the same version:
    the alias is resolved once, in the driver, and moving it later does not reach a running app."""
    from pipeline.serve.app import _portable

    cfg = make_cfg(store, "registry.model_name=pin-test", "serve.draft_uri=models:/pin-test@candidate")
    make_draft(cfg, target, tmp_path / "d0", seed=0)
    registry.register(cfg, tmp_path / "d0")
    built = _portable(cfg)
    make_draft(cfg, target, tmp_path / "d1", seed=1)
    registry.register(cfg, tmp_path / "d1")  # candidate moves to version 2
    assert built["serve"]["draft_uri"] == "models:/pin-test/1"
    assert _portable(cfg)["serve"]["draft_uri"] == "models:/pin-test/2"  # the next deploy follows the alias
    assert _portable(make_cfg(store, "serve.draft_uri=null"))["serve"]["draft_uri"] is None


def test_wrong_target_refused(store, target, tmp_path):
    """Same shape, other weights: refused by the weights hash; other vocab: by the vocab size;
    another tokenizer or chat template: by their hashes. Registered and directory drafts alike."""
    cfg = make_cfg(store, "registry.model_name=lineage-refuse")
    make_draft(cfg, target, tmp_path / "d")
    registry.register(cfg, tmp_path / "d")
    other = build_tiny_target(dict(cfg.target.tiny), torch.float32, seed=1)
    before = downloads(cfg)
    with pytest.raises(ValueError, match="target_weights_sha256: recorded"):
        drafts.load_draft_uri("models:/lineage-refuse@candidate", other, cfg)
    assert downloads(cfg) == before  # refused, and removed all the same
    with pytest.raises(ValueError, match="target_weights_sha256: recorded"):
        drafts.load_draft_uri(tmp_path / "d", other, cfg)
    with pytest.raises(ValueError, match="vocab_size: recorded"):
        drafts.load_draft_uri(tmp_path / "d", make_target("llama"), cfg)
    with pytest.raises(ValueError, match="cannot resolve"):
        drafts.load_draft_uri("models:/lineage-refuse@champion", target, cfg)
    target.tokenizer.chat_template += "{# another template #}"
    target._fingerprint = None  # the fingerprint is computed once per target object
    try:
        for uri in ("models:/lineage-refuse@candidate", tmp_path / "d"):
            with pytest.raises(ValueError, match="chat_template_sha256: recorded") as refused:
                drafts.load_draft_uri(uri, target, cfg)
            assert "tokenizer" not in str(refused.value) and "target weights" not in str(refused.value)
    finally:
        target.tokenizer.chat_template = target.tokenizer.chat_template.removesuffix("{# another template #}")
        target._fingerprint = None


def test_export_and_ui_commands(store, target, tmp_path, capsys):
    """griffin export (both layouts, from a registry URI) and griffin mlflow-ui's instructions."""
    from pipeline.cli import main

    cfg = make_cfg(store, "registry.model_name=export-test")
    make_draft(cfg, target, tmp_path / "d")
    registry.register(cfg, tmp_path / "d")
    for layout in ("griffin-upstream", "hf"):
        argv = [
            "export",
            "-c",
            "jobs/configs/tiny.yaml",
            f"output_dir={store}",
            "registry.model_name=export-test",
            "--to",
            layout,
            "--source",
            "models:/export-test@candidate",
            "--out",
            str(tmp_path / layout),
        ]
        assert main(argv) == 0
    assert (tmp_path / "griffin-upstream" / "pytorch_model.bin").is_file()
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    command = registry.run_mlflow_ui(cfg, launch=False)["command"]
    assert command[-4:-2] == ["--host", "127.0.0.1"] and cfg.tracking_uri in command


@pytest.fixture
def mlflow_server(tmp_path):
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job-runner processes
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{tmp_path / 'server.db'}",
        "--serve-artifacts",
        "--artifacts-destination",
        str(tmp_path / "artifacts"),
    ]
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    # A deadline, not a count of polls: on 2 loaded cores the server's imports alone took over 60 s.
    deadline = time.monotonic() + STARTUP_S
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "server.log").read_text()
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"mlflow server did not start in {STARTUP_S} s:\n" + (tmp_path / "server.log").read_text()
                    )
                time.sleep(0.25)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and its uvicorn worker
        server.wait(timeout=30)
        log.close()


def test_remote_server(mlflow_server, target, tmp_path):
    """Against a real `mlflow server --serve-artifacts`: register -> alias -> load -> same logits."""
    cfg = make_cfg(tmp_path / "out", f"tracking.tracking_uri={mlflow_server}")
    draft = make_draft(cfg, target, tmp_path / "d")
    info = registry.register(cfg, tmp_path / "d")
    assert info["created"] and info["aliases"] == ["candidate"]
    assert registry.promote(cfg, info["version"], 1.5)["promoted"]
    loaded = drafts.load_draft_uri(f"models:/{cfg.model_name}@champion", target, cfg)
    assert torch.equal(logits(loaded), logits(draft))
    assert registry.register(cfg, tmp_path / "d")["created"] is False
