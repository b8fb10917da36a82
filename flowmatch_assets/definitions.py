"""The code location: every asset, check, sensor and resource of flowmatch.

Loaded by `dagster dev` through workspace.yaml (``python_module: flowmatch_assets.definitions``).
Settings come from FLOWMATCH_* environment variables (see resources.resource_from_env).
"""

import os

import dagster as dg

from flowmatch_assets.budget_assets import budget_report
from flowmatch_assets.data_assets import images_256, images_256_complete, pd12m_metadata
from flowmatch_assets.embedding_assets import EMBEDDING_CHECKS, encode_embeddings
from flowmatch_assets.partitions import pd12m_partition_sensor
from flowmatch_assets.resources import FlowmatchResource, resource_from_env
from flowmatch_assets.state import build_verify_sensor
from flowmatch_assets.training_assets import evaluation, flow_model, samples

ASSETS = [
    pd12m_metadata,
    images_256,
    encode_embeddings,
    flow_model,
    samples,
    evaluation,
    budget_report,
]
CHECKS = [images_256_complete, *EMBEDDING_CHECKS]

ingest_job = dg.define_asset_job(
    "ingest_images",
    selection=dg.AssetSelection.assets(pd12m_metadata, images_256),
    description="Metadata and 256px images of the chosen partition(s).",
)
train_job = dg.define_asset_job(
    "train_job",
    selection=dg.AssetSelection.assets(flow_model, samples),
    description="Start or resume training on the covered partitions, then render the sample grid.",
)
embed_job = dg.define_asset_job(
    "encode_embeddings_job",
    selection=dg.AssetSelection.assets(encode_embeddings),
    description="DC-AE latents, DINOv2 features and Gemma3 caption embeddings of the chosen partition(s).",
)


def resources_for(flowmatch: FlowmatchResource) -> dict:
    """Every resource the assets need, around one FlowmatchResource."""
    return {"flowmatch": flowmatch, "pipes_subprocess_client": dg.PipesSubprocessClient()}


#: Assets that may follow their upstream automatically (FLOWMATCH_AUTOMATION=eager).
AUTOMATABLE = {"images_256", "vae_latents", "dino_features", "text_embeddings"}


def with_automation(assets: list, mode: str) -> list:
    """``mode`` "eager": images and embeddings materialize as soon as their upstream partition
    does (AutomationCondition.eager()); "off": nothing is automatic (the default)."""
    if mode == "off":
        return assets
    if mode != "eager":
        raise ValueError(f"FLOWMATCH_AUTOMATION={mode!r}: use off or eager")
    return list(
        dg.map_asset_specs(
            lambda spec: (
                spec.replace_attributes(automation_condition=dg.AutomationCondition.eager())
                if spec.key.to_user_string() in AUTOMATABLE
                else spec
            ),
            assets,
        )
    )


#: Steps fork from a server that has already imported this module (and dagster, pyarrow, ...),
#: so a partition's step starts in a fraction of a second instead of re-importing everything.
local_executor = dg.multiprocess_executor.configured(
    {"start_method": {"forkserver": {"preload_modules": ["flowmatch_assets.definitions"]}}}
)


def build_definitions(
    executor: dg.ExecutorDefinition | None = None, automation: str | None = None
) -> dg.Definitions:
    """All definitions; ``executor`` replaces Dagster's default multiprocess executor;
    ``automation`` (default: FLOWMATCH_AUTOMATION or "off") see :func:`with_automation`."""
    mode = automation or os.environ.get("FLOWMATCH_AUTOMATION", "off")
    return dg.Definitions(
        assets=with_automation(ASSETS, mode),
        asset_checks=CHECKS,
        sensors=[pd12m_partition_sensor, build_verify_sensor()],
        jobs=[ingest_job, embed_job, train_job],
        resources=resources_for(resource_from_env()),
        executor=executor or local_executor,
    )


defs = build_definitions()
