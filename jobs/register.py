"""Ray job entrypoint: `python -m jobs.register -c CONFIG [flags] [section.field=value ...]`, i.e. `griffin register`."""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["register", *sys.argv[1:]]))
