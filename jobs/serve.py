"""Ray job entrypoint: `python -m jobs.serve -c CONFIG [flags] [section.field=value ...]`, i.e. `griffin serve`."""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
