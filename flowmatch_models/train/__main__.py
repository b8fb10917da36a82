"""``python -m flowmatch_models.train --config run.yaml``: the training entry point (run.py)."""

import sys

from flowmatch_models.train.run import main

if __name__ == "__main__":
    sys.exit(main())
