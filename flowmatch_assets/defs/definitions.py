"""Every asset, check, sensor, job and resource of flowmatch, put together.

``flowmatch_assets.definitions`` (the code location workspace.yaml names) is
``build_definitions()``; ``flowmatch_assets.definitions_k8s`` the same with the k8s executor.
Settings are the ``flowmatch`` resource, ``FlowmatchSettings`` (defs/resources.py): unset here, so
each comes from its FLOWMATCH_* environment variable when a run's resources are built; a
deployment's code location sets the ones it must have (``dg.EnvVar``, definitions_k8s.py). The embedding assets and their checks are built from the
registry of embedding kinds (flowmatch_models.embeddings) each time definitions are built.
"""

import os

import dagster as dg

from flowmatch_assets.defs.budget_assets import budget_report
from flowmatch_assets.defs.checks import build_fresh_checks, fine_tune_fresh, flow_model_fresh
from flowmatch_assets.defs.data_assets import images, images_complete, metadata
from flowmatch_assets.defs.data_card_assets import data_card, dataset_card
from flowmatch_assets.defs.embedding_assets import build_encode_embeddings
from flowmatch_assets.defs.embedding_checks import build_embedding_checks
from flowmatch_assets.defs.evaluation_assets import evaluation, samples
from flowmatch_assets.defs.partitions import (
    metadata_partition_sensor,
    shard_partitions,
    source_partition_sensor,
)
from flowmatch_assets.defs.resources import FlowmatchResource, FlowmatchSettings
from flowmatch_assets.defs.sensors import build_verify_sensor
from flowmatch_assets.defs.training_assets import fine_tune, flow_model
from flowmatch_assets.defs.training_pipes import TrainingPipesClient, stop_timeout_s
from flowmatch_assets.freshness.fingerprints import code_version
from flowmatch_models.embeddings.kinds import KINDS, TRAINING_INPUTS


def assets() -> list:
    """Every asset, the embedding kinds as registered now; flow_model depends on every
    training input."""
    encode = build_encode_embeddings(list(KINDS.values()))
    train = flow_model.map_asset_specs(
        lambda spec: spec.replace_attributes(deps=list(TRAINING_INPUTS))
    )
    tune = fine_tune.map_asset_specs(
        lambda spec: spec.replace_attributes(deps=["flow_model", *TRAINING_INPUTS])
    )
    text_kinds = [k.name for k in KINDS.values() if k.encoder == "text"]
    card = data_card.map_asset_specs(
        lambda spec: spec.replace_attributes(deps=[*spec.deps, *text_kinds])
    )
    data = dg.map_asset_specs(  # their code version is a fingerprint field too
        lambda spec: spec.replace_attributes(code_version=code_version(spec.key.to_user_string())),
        [metadata, images],
    )
    return [*data, encode, train, tune, samples, evaluation, budget_report, card, dataset_card]


def checks() -> list:
    """Every asset check, the embedding kinds' as registered now."""
    return [
        images_complete,
        *build_embedding_checks(list(KINDS.values())),
        build_fresh_checks(shard_partitions),
        flow_model_fresh,
        fine_tune_fresh,
    ]


def all_assets_and_checks() -> list:
    """What an in-process ``dg.materialize`` gets: every asset and check (the CLI, tests)."""
    return [*assets(), *checks()]


ingest_job = dg.define_asset_job(
    "ingest_images",
    selection=dg.AssetSelection.assets(metadata, images),
    description="Metadata and 256px images of the chosen partition(s).",
)
embed_job = dg.define_asset_job(
    "encode_embeddings_job",
    selection=dg.AssetSelection.groups("embeddings"),
    description="DC-AE latents, DINOv2 features and Gemma3 caption embeddings of the chosen partition(s).",
)
lineage_job = dg.define_asset_job(
    "ingest_and_embed_job",
    selection=dg.AssetSelection.groups("data", "embeddings"),
    description="A partition's whole data lineage: metadata, 256px images and every embedding "
    "(what `flowmatch materialize` and the demo run, one run per partition).",
)
train_job = dg.define_asset_job(
    "train_job",
    selection=dg.AssetSelection.assets(flow_model, samples),
    description="Start or resume training on the covered partitions, then render the sample grid.",
)
finetune_job = dg.define_asset_job(
    "finetune_job",
    selection=dg.AssetSelection.assets(fine_tune, samples),
    description="Fine-tune: a new run from another run's weights, on the chosen sources; then "
    "render its sample grid (set samples' run_name to the fine-tune's).",
)
evaluation_job = dg.define_asset_job(
    "evaluation_job",
    selection=dg.AssetSelection.assets(evaluation),
    description="Caption following and held-out FD-DINOv2 of a run's checkpoint(s).",
)
reports_job = dg.define_asset_job(
    "reports_job",
    selection=dg.AssetSelection.groups("reports"),
    description="The budget report and the data cards (per partition, and the whole dataset's).",
)

#: Every job, the narrowest selection first: a run the CLI makes (runs.run_assets) is recorded
#: under the first whose selection holds all it materializes, so the UI lists it by that name.
JOBS = [ingest_job, embed_job, lineage_job, train_job, finetune_job, evaluation_job, reports_job]


def resources_for(flowmatch: FlowmatchResource | FlowmatchSettings) -> dict:
    """Every resource the assets need, around one FlowmatchResource (the code location's: the
    FlowmatchSettings that build it when a run starts)."""
    client = TrainingPipesClient(termination_timeout_seconds=stop_timeout_s())
    return {"flowmatch": flowmatch, "pipes_subprocess_client": client}


#: Assets that may follow their upstream automatically (FLOWMATCH_AUTOMATION=eager): images
#: and every EmbeddingKind as registered
AUTOMATABLE = {"images", *KINDS}


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


#: A run's steps execute in the run's own process, one after the other: a partition's run is
#: a chain of steps anyway, and parallel partitions are parallel runs (the run queue's
#: max_concurrent_runs; the gpu pool still bounds encoder and training steps). No step process
#: to start and no second import of the definitions: BENCHMARKS.md "Orchestration".
local_executor = dg.in_process_executor


def build_definitions(
    executor: dg.ExecutorDefinition | None = None,
    automation: str | None = None,
    settings: FlowmatchSettings | None = None,
) -> dg.Definitions:
    """All definitions; ``executor`` replaces Dagster's default multiprocess executor;
    ``automation`` (default: FLOWMATCH_AUTOMATION or "off") see :func:`with_automation`;
    ``settings``: the deployment's (default: every one from the environment, when a run starts)."""
    mode = automation or os.environ.get("FLOWMATCH_AUTOMATION", "off")
    return dg.Definitions(
        assets=with_automation(assets(), mode),
        asset_checks=checks(),
        sensors=[metadata_partition_sensor, source_partition_sensor, build_verify_sensor()],
        jobs=JOBS,
        resources=resources_for(settings or FlowmatchSettings()),
        executor=executor or local_executor,
    )
