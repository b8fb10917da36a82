"""``python -m flowmatch_models.train --config run.yaml``: the training entry point (run.py).

The stop handlers are installed first (signals.py: a signal during the imports and the data
set-up is a stop, said in one line with exit 75, not a traceback)."""

import sys

from flowmatch_models.train import signals

signals.EARLY = signals.SignalStop()
signals.EARLY.install()

from flowmatch_models.train.run import main  # noqa: E402 - after the handlers

if __name__ == "__main__":
    sys.exit(main())
