"""Ray job entrypoint: `python -m jobs.train -c CONFIG [flags] [section.field=value ...]`, i.e. `griffin train`."""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
