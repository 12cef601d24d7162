"""Ray job entrypoint: `python -m jobs.run -c CONFIG [section.field=value ...]`."""

import sys

from jobs._entry import main

if __name__ == "__main__":
    sys.exit(main("pipeline.run:run_all"))
