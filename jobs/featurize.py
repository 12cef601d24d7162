"""Ray job entrypoint: `python -m jobs.featurize -c CONFIG [flags] [section.field=value ...]`, i.e. `griffin featurize`."""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["featurize", *sys.argv[1:]]))
