"""The training process's Pipes messages arrive whole, however the writer's bytes land: a
message seen half-written (a large one, the loss curve's picture) waits for its newline. With
Dagster's own file reader the half was parsed, its reader thread died, every later message was
lost and a finished training run read as failed (`flowmatch demo`: "the training process ended
without reporting a TrainResult" after step 2,000)."""

import sys

import dagster as dg

from flowmatch_assets.defs.pipes_messages import WholeLinesMessageReader
from flowmatch_assets.defs.training_pipes import TrainingPipesClient

BIG = 200_000
#: a child that writes one large Pipes message in two parts 0.3 s apart (as a buffered write of
#: a big line can land), then reports its materialization
WRITER = f"""
import json, time
from dagster_pipes import (PIPES_PROTOCOL_VERSION, PIPES_PROTOCOL_VERSION_FIELD,
                           PipesEnvVarParamsLoader, open_dagster_pipes)
with open_dagster_pipes() as pipes:
    path = PipesEnvVarParamsLoader().load_messages_params()["path"]
    message = {{PIPES_PROTOCOL_VERSION_FIELD: PIPES_PROTOCOL_VERSION, "method": "log",
               "params": {{"message": "y" * {BIG}, "level": "INFO"}}}}
    line = json.dumps(message) + "\\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line[:1000]); f.flush(); time.sleep(0.3); f.write(line[1000:])
    pipes.report_asset_materialization(metadata={{"chars": {BIG}}})
"""


@dg.asset
def torn(context: dg.AssetExecutionContext, pipes_subprocess_client: TrainingPipesClient):
    command = [sys.executable, "-c", WRITER]
    return pipes_subprocess_client.run(context=context, command=command).get_materialize_result()


def _run(client: TrainingPipesClient):
    with dg.instance_for_test() as instance:
        result = dg.materialize(
            [torn],
            resources={"pipes_subprocess_client": client},
            instance=instance,
            raise_on_error=False,
        )
        logs = [r.user_message for r in instance.all_logs(result.run_id)]
    return result, logs


def test_a_message_written_in_two_parts_arrives_whole():
    client = TrainingPipesClient(termination_timeout_seconds=30)
    assert isinstance(client.message_reader, WholeLinesMessageReader)  # the code location's
    result, logs = _run(client)
    assert result.success
    (mat,) = result.asset_materializations_for_node("torn")
    assert mat.metadata["chars"].value == BIG
    assert "y" * BIG in logs  # the large message itself, whole


def test_dagster_s_own_reader_still_loses_it():
    """Why WholeLinesMessageReader exists: when this fails, Dagster's reader reads whole lines
    and ours may go (flowmatch_assets/defs/pipes_messages.py)."""
    client = TrainingPipesClient(
        termination_timeout_seconds=30, message_reader=dg.PipesTempFileMessageReader()
    )
    result, logs = _run(client)
    # the run "succeeds" with nothing the child reported: the message and all after it lost
    (mat,) = result.asset_materializations_for_node("torn")
    assert "chars" not in mat.metadata and "y" * BIG not in logs
