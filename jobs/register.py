"""Ray job entrypoint: `python -m jobs.register -c CONFIG [section.field=value ...]`."""

import sys

from jobs._entry import main

if __name__ == "__main__":
    sys.exit(main("pipeline.registry:run_register"))
