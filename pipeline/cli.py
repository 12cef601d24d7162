"""The ``griffin`` command: ``griffin <command> -c CONFIG.yaml [section.field=value ...] [flags]``.

Each command is one ``pipeline.<module>.run_<stage>(cfg, **flags)`` function, imported only when
called so that ``griffin --help`` stays fast and a stage's heavy imports stay in that stage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import shlex
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig, load_config
from pipeline.lock import EXIT_LOCKED, RunLocked, run_lock

DISTRIBUTION = "griffin-drafts"  # project.name in pyproject.toml

# command -> ("module:function", help)
COMMANDS: dict[str, tuple[str, str]] = {
    "assets": ("pipeline.resources.targets:run_assets", "prepare the target (PyPI asset -> safetensors cache)"),
    "check-target": (
        "pipeline.resources.check_target:run_check_target",
        "is the target's family supported, and is speculative decoding on it lossless (T=0, untrained draft)",
    ),
    "regenerate": ("pipeline.data.regenerate:run_regenerate", "the target answers the training conversations itself"),
    "featurize": ("pipeline.data.featurize:run_featurize", "run the target over conversations into the feature store"),
    "train": ("pipeline.train.driver:run_train", "token-alignable training on Ray Train"),
    "register": ("pipeline.registry.register:run_register", "register a trained draft in the MLflow registry"),
    "export": ("pipeline.registry.export:run_export", "export a draft to another layout"),
    "ship": ("pipeline.registry.ship:run_ship", "write a measured draft with its model card into drafts/"),
    "serve": ("pipeline.serve.lifecycle:run_serve", "serve target + draft with Ray Serve"),
    "eval": ("pipeline.evaluate.evaluate:run_eval", "measure acceptance length and speedup against baselines"),
    "tune-tree": ("pipeline.evaluate.tune:run_tune_tree", "pick the tree budget that maximises expected tokens/s here"),
    "bench-serve": ("pipeline.evaluate.loadtest:run_bench_serve", "load-test the Serve endpoint"),
    "run": ("pipeline.run:run_all", "every stage end to end"),
    "submit": ("pipeline.submit:run_submit", "submit one stage as a Ray job to --address"),
    "mlflow-ui": ("pipeline.registry.register:run_mlflow_ui", "browse the run's MLflow store"),
}


def package_version() -> str:
    """The installed distribution's version; a source checkout that is not installed (``PYTHONPATH=.``)
    reads it from its pyproject.toml, so the version printed is always the code's own."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="griffin",
        description="GRIFFIN speculative decoding: griffin <command> -c CONFIG.yaml [section.field=value ...]",
    )
    parser.add_argument("--version", action="version", version=f"griffin {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == "submit":  # before the overrides, so that they stay a trailing list
            # optional only for --attach, which follows a job already submitted (main checks)
            p.add_argument("stage", nargs="?", help="featurize | train | register | eval | serve | run")
        p.add_argument("-c", "--config", required=name != "submit", help="run config YAML (see jobs/configs/)")
        p.add_argument("overrides", nargs="*", help="section.field=value overrides")
        if name == "featurize":
            p.add_argument("--verify", metavar="STORE", help="re-check a store's checksums and row counts")
            p.add_argument(
                "--repair",
                action="store_true",
                default=None,
                help="with --verify: keep one copy of each sample (drops repeated parts and rows)",
            )
        if name == "train":
            p.add_argument("--stage", type=int, help="run only this stage of the schedule")
        if name == "register":
            p.add_argument("--checkpoint", help="a draft directory (default: the run's best checkpoint)")
            p.add_argument("--promote", action="store_true", help="move 'champion' if tau beats it")
        if name == "export":
            p.add_argument(
                "--to",
                required=True,
                choices=["griffin-upstream", "hf", "speculators", "specforge"],
                help="griffin-upstream | hf (any variant) | speculators, specforge (eagle3 drafts)",
            )
            p.add_argument(
                "--verifier",
                help="speculators/specforge: the target as the consumer loads it, an HF "
                "id or a path (default: where this run's target was loaded from)",
            )
        if name in ("export", "ship"):
            p.add_argument("--source", help="draft directory or models:/ URI (export's default: the run's best)")
            p.add_argument("--out", help="output directory (ship's default: drafts/<target>/<variant>)")
        if name == "ship":
            p.add_argument("--report", help="the evaluation report.json that measured the draft")
            p.add_argument("--method", help="the draft's method label in that report (default griffin)")
        if name == "submit":
            p.add_argument("--address", required=True, help="Ray dashboard address, e.g. http://HEAD:8265")
            p.add_argument("--no-wait", action="store_true", default=None, help="return after submitting")
            p.add_argument(
                "--timeout",
                type=float,
                metavar="SECONDS",
                help="stop following the logs after SECONDS (the job keeps running; re-attach with --attach)",
            )
            p.add_argument("--attach", metavar="JOB_ID", help="follow an already submitted job's logs to its end")
        if name == "bench-serve":
            add_bench_serve_flags(p)
        if name in ("eval", "tune-tree"):
            p.add_argument("--draft", help="draft URI or directory (default: the run's candidate)")
        if name == "check-target":
            add_check_target_flags(p)
        if name == "tune-tree":
            p.add_argument("--prompts", type=int, help="calibration prompts (default decode.tune_prompts)")
            p.add_argument(
                "--max-new-tokens", type=int, help="tokens per calibration prompt (default decode.tune_max_new_tokens)"
            )
    return parser


def add_check_target_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config-only", action="store_true", default=None, help="only the family check: load no weights")
    p.add_argument("--prompts", type=int, help="prompts decoded (default 3; the first is longer than any window)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per prompt (default 24)")


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,4, got {text!r}") from None
    if min(levels) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels are at least 1, got {text!r}")
    return levels


def add_bench_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="any OpenAI-style endpoint, e.g. http://host:8000 (default: serve.port here)")
    p.add_argument("--api-key", help="sent as Authorization: Bearer (left out of the run lock's record)")
    p.add_argument("--model", help="the model to request (default: the first in GET /v1/models)")
    p.add_argument("--levels", type=_levels, help="concurrency levels, comma-separated (default 1,2,4,8,16)")
    p.add_argument(
        "--requests", dest="requests_per_level", type=int, help="requests per level (default 2 x concurrency, >= 4)"
    )
    p.add_argument("--max-tokens", type=int, help="completion tokens per request (default 64)")
    p.add_argument("--max-retries", type=int, help="retries of a 503/429 after its Retry-After (default 5)")


def split_extra(extra: list[str]) -> tuple[list[str], list[str]]:
    """Leftover arguments -> (overrides, flags): ``a.b=1 --stage 2 --promote c=2`` ->
    (["a.b=1", "c=2"], ["--stage", "2", "--promote"]). A bare word after a flag is its value."""
    overrides, flags = [], []
    for item in extra:
        if item.startswith("-"):
            flags.append(item)
        elif "=" in item:
            overrides.append(item)
        elif flags and flags[-1].startswith("-"):
            flags.append(item)
        else:
            overrides.append(item)  # not an override: load_config names it
    return overrides, flags


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # overrides may come anywhere between options (argparse takes a positional list only once)
    args, extra = parser.parse_known_args(argv)
    if args.command == "submit" and args.attach:
        return attach(args, extra)
    if args.command == "submit" and not (args.stage and args.config):
        parser.error("griffin submit needs STAGE and -c CONFIG (or --attach JOB_ID)")
    overrides, stage_flags = split_extra(extra)
    if stage_flags and args.command != "submit":
        parser.error(f"unrecognized arguments: {' '.join(stage_flags)}")
    if stage_flags:  # `griffin submit train --stage 2`: the stage's own flags travel with the job
        parser.parse_args([args.stage, "-c", args.config, *stage_flags])  # checks them (exits 2 on a bad one)
    args.overrides = [*args.overrides, *overrides]
    flags = {k: v for k, v in vars(args).items() if k not in {"command", "config", "overrides"} and v is not None}
    log: Path | None = None
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "submit":  # the job re-reads the same file and overrides on the cluster
            flags.update(config_path=args.config, overrides=args.overrides, stage_flags=stage_flags)
        with lease(args.command, cfg, flags, sys.argv[1:] if argv is None else argv):
            module_name, func_name = COMMANDS[args.command][0].split(":")
            command = getattr(importlib.import_module(module_name), func_name)
            if args.command in QUIET_COMMANDS:
                log = log_path(cfg, args.command)
                result = run_quietly(args.command, command, cfg, flags, log)
            else:
                result = command(cfg, **flags)
    except RunLocked as error:  # another live command writes this run directory: nothing was touched
        print(f"griffin {args.command}: refused: {error}", file=sys.stderr)
        return EXIT_LOCKED
    except (ValueError, FileNotFoundError) as error:  # bad input: the message names the fix
        print(f"griffin {args.command}: error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # a stage that failed and says why (e.g. an interrupted featurize)
        print(f"griffin {args.command}: failed: {error}" + (f" (details in {log})" if log else ""), file=sys.stderr)
        return 1
    except Exception as error:
        if log is None:
            raise
        print(f"griffin {args.command}: failed: {type(error).__name__}: {error} (traceback in {log})", file=sys.stderr)
        return 1
    if isinstance(result, dict) and args.command not in QUIET_COMMANDS:  # a quiet command printed its summary
        print(json.dumps(result, indent=2, default=str))
    return exit_code(result)


def exit_code(result: Any) -> int:
    # a command may say more than pass/fail: `griffin submit` that stopped following a running job
    if isinstance(result, dict) and "exit_code" in result:
        return int(result["exit_code"])
    return 0 if result is not False else 1


# The commands that write the run directory hold its lease (pipeline.lock) while they run. The others
# only read it (mlflow-ui, featurize --verify without --repair), write elsewhere (assets: the cache; ship: drafts/), run
# beside a writer for days (serve reads a finished draft) or run nowhere near it (submit: the job's
# driver runs jobs/<stage>.py -> main, and takes the lease there, where the stage runs).
LOCKED_COMMANDS = ("regenerate", "featurize", "train", "register", "export", "eval", "tune-tree", "bench-serve", "run")


def lease(command: str, cfg: RunConfig, flags: dict[str, Any], argv: list[str]) -> AbstractContextManager:
    if command not in LOCKED_COMMANDS or (command == "featurize" and flags.get("verify") and not flags.get("repair")):
        return nullcontext()
    return run_lock(cfg.run_dir, shlex.join(["griffin", *redacted(argv)]))


SECRET_FLAGS = ("--api-key",)


def redacted(argv: list[str]) -> list[str]:
    """The command line with secrets masked: the lease records it, and a refusal prints it to others."""
    out = list(argv)
    for i, item in enumerate(out):
        flag = item.split("=", 1)[0]
        if flag in SECRET_FLAGS and "=" in item:
            out[i] = f"{flag}=***"
        elif item in SECRET_FLAGS and i + 1 < len(out):
            out[i + 1] = "***"
    return out


def attach(args: argparse.Namespace, extra: list[str]) -> int:
    """``griffin submit --attach JOB_ID --address ...``: no config, no stage; the job has both."""
    from pipeline.submit import run_attach

    if args.stage or args.config or args.overrides or extra:
        print("griffin submit: error: --attach takes only --address and --timeout", file=sys.stderr)
        return 2
    try:
        result = run_attach(args.attach, args.address, args.timeout)
    except RuntimeError as error:  # the job ended as FAILED or STOPPED: its message says why
        print(f"griffin submit: failed: {error}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, default=str))
    return exit_code(result)


QUIET_COMMANDS = ("run",)  # long commands whose console is a line per stage; the rest goes to a log file


def log_path(cfg: RunConfig, command: str) -> Path:
    return cfg.run_dir.resolve() / "logs" / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}.log"


def run_quietly(name: str, command: Any, cfg: RunConfig, flags: dict[str, Any], log: Path) -> Any:
    """``command`` with its console reduced to ``pipeline.console`` lines; everything else, and the
    traceback of a failure, goes to ``log``."""
    from pipeline import console

    with console.quiet(log):
        console.say(f"griffin {name} {cfg.run_name}: logs in {log}")
        try:
            return command(cfg, **flags)
        except Exception:
            logging.getLogger("griffin").exception("the command failed")
            raise


if __name__ == "__main__":
    sys.exit(main())
