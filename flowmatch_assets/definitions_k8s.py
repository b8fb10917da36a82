"""The code location for a Kubernetes deployment: every step runs in its own pod
(``k8s_job_executor``), with the CPU/GPU requests of flowmatch_assets.defs.deploy on each asset.

Load it in the Helm chart's user-code deployment with
``dagster api grpc -m flowmatch_assets.definitions_k8s`` (see docs/scaling-out.md).
"""

from dagster_k8s import k8s_job_executor

from flowmatch_assets.defs.definitions import build_definitions

defs = build_definitions(executor=k8s_job_executor.configured({"max_concurrent": 64}))
