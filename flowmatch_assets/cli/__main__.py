"""``python -m flowmatch_assets.cli``: the `flowmatch` command."""

import sys

from flowmatch_assets.cli.main import main

sys.exit(main())
