"""The ``griffin`` command: ``griffin <command> -c CONFIG.yaml [section.field=value ...] [flags]``.

Each command is one ``pipeline.<module>.run_<stage>(cfg, **flags)`` function, imported only when
called so that ``griffin --help`` stays fast and a stage's heavy imports stay in that stage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from pipeline.config import load_config

# command -> ("module:function", help)
COMMANDS: dict[str, tuple[str, str]] = {
    "assets": ("pipeline.assets_cli:run_assets", "prepare the target (PyPI asset -> safetensors cache)"),
    "featurize": ("pipeline.featurize:run_featurize", "run the target over conversations into the feature store"),
    "train": ("pipeline.train:run_train", "token-alignable training on Ray Train"),
    "register": ("pipeline.registry:run_register", "register a trained draft in the MLflow registry"),
    "export": ("pipeline.registry:run_export", "export a draft to another layout"),
    "serve": ("pipeline.serve:run_serve", "serve target + draft with Ray Serve"),
    "eval": ("pipeline.evaluate:run_eval", "measure acceptance length and speedup against baselines"),
    "tune-tree": ("pipeline.tune:run_tune_tree", "pick the tree budget that maximises expected tokens/s here"),
    "bench-serve": ("pipeline.loadtest:run_bench_serve", "load-test the Serve endpoint"),
    "run": ("pipeline.run:run_all", "every stage end to end"),
    "submit": ("pipeline.submit:run_submit", "submit one stage as a Ray job to --address"),
    "mlflow-ui": ("pipeline.registry:run_mlflow_ui", "browse the run's MLflow store"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="griffin", description="GRIFFIN speculative decoding: griffin <command> -c CONFIG.yaml [section.field=value ...]")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == "submit":  # before the overrides, so that they stay a trailing list
            p.add_argument("stage", help="featurize | train | register | eval | serve | run")
        p.add_argument("-c", "--config", required=True, help="run config YAML (see jobs/configs/)")
        p.add_argument("overrides", nargs="*", help="section.field=value overrides")
        if name == "featurize":
            p.add_argument("--verify", metavar="STORE", help="re-check a store's checksums and row counts")
        if name == "train":
            p.add_argument("--stage", type=int, help="run only this stage of the schedule")
        if name == "register":
            p.add_argument("--checkpoint", help="a draft directory (default: the run's best checkpoint)")
            p.add_argument("--promote", action="store_true", help="move 'champion' if tau beats it")
        if name == "export":
            p.add_argument("--to", required=True, choices=["griffin-upstream", "hf"])
            p.add_argument("--source", help="draft directory or models:/ URI (default: the run's best)")
            p.add_argument("--out", help="output directory")
        if name == "submit":
            p.add_argument("--address", required=True, help="Ray dashboard address, e.g. http://HEAD:8265")
            p.add_argument("--no-wait", action="store_true", default=None, help="return after submitting")
        if name in ("eval", "tune-tree"):
            p.add_argument("--draft", help="draft URI or directory (default: the run's candidate)")
        if name == "tune-tree":
            p.add_argument("--prompts", type=int, help="calibration prompts (default 4)")
            p.add_argument("--max-new-tokens", type=int, help="tokens per calibration prompt (default 64)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # overrides may come anywhere between options (argparse takes a positional list only once)
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = [*args.overrides, *extra]
    flags = {k: v for k, v in vars(args).items() if k not in {"command", "config", "overrides"} and v is not None}
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "submit":  # the job re-reads the same file and overrides on the cluster
            flags.update(config_path=args.config, overrides=args.overrides)
        module_name, func_name = COMMANDS[args.command][0].split(":")
        result = getattr(importlib.import_module(module_name), func_name)(cfg, **flags)
    except (ValueError, FileNotFoundError) as error:  # bad input: the message names the fix
        print(f"griffin {args.command}: error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # a stage that failed and says why (e.g. an interrupted featurize)
        print(f"griffin {args.command}: failed: {error}", file=sys.stderr)
        return 1
    if isinstance(result, dict):
        print(json.dumps(result, indent=2, default=str))
    return 0 if result is not False else 1


if __name__ == "__main__":
    sys.exit(main())
