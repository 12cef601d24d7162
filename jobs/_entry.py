"""Shared body of the ``ray job submit`` entrypoints: parse, load the config, run one stage."""

from __future__ import annotations

import argparse
import importlib
import json
import sys


def main(target: str, argv: list[str] | None = None) -> int:
    """``target`` is "module:function"; the function takes the RunConfig."""
    parser = argparse.ArgumentParser(description=f"run {target} on the current Ray cluster")
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args(argv)
    from pipeline.config import load_config

    cfg = load_config(args.config, args.overrides)
    module, func = target.split(":")
    try:
        result = getattr(importlib.import_module(module), func)(cfg)
    except (ValueError, FileNotFoundError) as error:
        print(f"{target}: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2, default=str) if isinstance(result, dict) else result)
    return 0
