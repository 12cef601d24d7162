"""Ray job entrypoint: `python -m jobs.evaluate -c CONFIG [flags] [section.field=value ...]`, i.e. `griffin eval`."""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
