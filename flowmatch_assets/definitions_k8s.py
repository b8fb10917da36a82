"""The code location for a Kubernetes deployment: every step runs in its own pod
(``k8s_job_executor``), with the CPU/GPU requests of flowmatch_assets.defs.deploy on each asset.

Load it in the Helm chart's user-code deployment with
``dagster api grpc -m flowmatch_assets.definitions_k8s`` (see docs/scaling-out.md). The data
root is the deployment's own setting: a run fails at launch, naming FLOWMATCH_DATA_ROOT, where
the pod lacks it (the chart's ``env`` sets it), instead of writing under ``data/``.
"""

import dagster as dg
from dagster_k8s import k8s_job_executor

from flowmatch_assets.defs.definitions import build_definitions
from flowmatch_assets.defs.resources import FlowmatchSettings

#: the settings this deployment must set; the others come from FLOWMATCH_* or their defaults
SETTINGS = FlowmatchSettings(data_root=dg.EnvVar("FLOWMATCH_DATA_ROOT"))

defs = build_definitions(
    executor=k8s_job_executor.configured({"max_concurrent": 64}), settings=SETTINGS
)
