"""Ray job entrypoint: `python -m jobs.run -c CONFIG [flags] [section.field=value ...]`, i.e. `griffin run`."""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
