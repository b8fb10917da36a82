"""Scale-out settings on existing engines: Kubernetes resource requests as op tags.

The tags are read by dagster-k8s (``k8s_job_executor`` / ``K8sRunLauncher``): each step of a
GPU asset becomes a pod that requests one GPU; elsewhere (local, multiprocess) they are inert.
``definitions_k8s.py`` is the code location that runs every step in its own pod.
"""

from __future__ import annotations

K8S_CONFIG = "dagster-k8s/config"


def k8s_tags(cpu: str, memory: str, gpus: int = 0) -> dict:
    """Op tags asking Kubernetes for ``cpu``, ``memory`` and ``gpus`` NVIDIA GPUs."""
    requests: dict = {"cpu": cpu, "memory": memory}
    limits: dict = {}
    if gpus:
        requests["nvidia.com/gpu"] = str(gpus)
        limits["nvidia.com/gpu"] = str(gpus)
    resources = {"requests": requests, **({"limits": limits} if limits else {})}
    return {K8S_CONFIG: {"container_config": {"resources": resources}}}


#: image download/decode: CPU-bound, many threads
IMAGE_TAGS = k8s_tags(cpu="4", memory="8Gi")
#: the three encoders on one GPU
ENCODER_TAGS = k8s_tags(cpu="8", memory="32Gi", gpus=1)
#: training: one pod per node; Lightning DDP spans its GPUs (set devices in the YAML)
TRAIN_TAGS = k8s_tags(cpu="16", memory="64Gi", gpus=1)

#: Dagster's concurrency pool of the steps that want a GPU (encoders, training)
GPU_POOL = "gpu"
#: the assets in that pool: the Celery run launcher sends a run holding any of them to the GPU
#: machines' queue, every other run to the CPU (download) machines' queue. tests/test_celery.py
#: checks this list against the definitions' pools.
GPU_ASSETS = frozenset(
    {"vae_latents", "dino_features", "text_embeddings", "flow_model", "fine_tune"}
)
