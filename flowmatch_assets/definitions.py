"""The code location `dagster dev` loads (workspace.yaml: ``flowmatch_assets.definitions``, ``defs``).

Everything is defined in :mod:`flowmatch_assets.defs`; this module only names the location.
"""

from flowmatch_assets.defs.definitions import build_definitions

defs = build_definitions()
