"""Runs on Celery workers that share nothing with the head but the services (issue 46).

:class:`FlowmatchCeleryRunLauncher` is dagster-celery's ``CeleryRunLauncher`` (each run, one
partition or a range of them, executes whole on one worker) with three things a fleet of cheap
machines needs:

- **Queues by kind of machine.** A run holding an asset of the ``gpu`` pool
  (:data:`~flowmatch_assets.defs.deploy.GPU_ASSETS`: the encoders, training) goes to the GPU
  queue, every other run (metadata, image download) to the CPU queue, unless the run already
  names one (the ``dagster-celery/queue`` tag). GPU machines run ``-q gpu``, download machines
  ``-q cpu``.
- **A dead worker is noticed.** Celery's task state stays ``STARTED`` when its worker is killed
  (``kill -9``, a lost spot machine), so dagster-celery's health check would say "running"
  forever. Here a started task's worker is pinged over the broker; ``misses`` pings in a row
  without an answer make the run FAILED, and the instance's ``run_retries`` start it again on
  another worker (its partitions' earlier publishes are whole or absent: the remote's marker is
  written last).
- **A waiting run says where it waits.** The debug info (shown when a run times out starting)
  names the queue, and the launch's engine event already does.

The instance config is ``deploy/dagster.celery.yaml``; docs/scaling-out.md has the commands.
"""

from __future__ import annotations

import logging

import dagster as dg
from dagster_celery.launcher import CeleryRunLauncher
from dagster_celery.tags import DAGSTER_CELERY_QUEUE_TAG, DAGSTER_CELERY_TASK_ID_TAG

from flowmatch_assets.compat import run_launcher_api
from flowmatch_assets.defs.deploy import GPU_ASSETS

LaunchRunContext, CheckRunHealthResult, WorkerStatus = run_launcher_api()

log = logging.getLogger(__name__)


def queue_for(asset_keys, gpu_queue: str, cpu_queue: str) -> str:
    """The queue of a run that materializes ``asset_keys`` (None: the whole job, so GPU)."""
    if asset_keys is None:
        return gpu_queue
    names = {k.to_user_string() for k in asset_keys}
    return gpu_queue if names & GPU_ASSETS else cpu_queue


class FlowmatchCeleryRunLauncher(CeleryRunLauncher):
    """dagster-celery's run launcher, routing runs by machine kind and noticing dead workers."""

    def __init__(self, gpu_queue: str = "gpu", ping_misses: int = 2, ping_timeout_s=2.0, **kw):
        self.gpu_queue = gpu_queue
        self.ping_misses = int(ping_misses)
        self.ping_timeout_s = float(ping_timeout_s)
        self._missed: dict[str, int] = {}
        super().__init__(**kw)

    @classmethod
    def config_type(cls):
        return {
            **CeleryRunLauncher.config_type(),
            "gpu_queue": dg.Field(
                dg.StringSource,
                is_required=False,
                default_value="gpu",
                description="The queue of runs holding an encoder or training asset "
                "(default_queue takes the others).",
            ),
            "ping_misses": dg.Field(
                int,
                is_required=False,
                default_value=2,
                description="Health checks in a row whose worker did not answer a ping "
                "before its run is failed (and retried by run_retries).",
            ),
            "ping_timeout_s": dg.Field(float, is_required=False, default_value=2.0),
        }

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        if DAGSTER_CELERY_QUEUE_TAG not in run.tags:
            queue = queue_for(run.asset_selection, self.gpu_queue, self.default_queue)
            self._instance.add_run_tags(run.run_id, {DAGSTER_CELERY_QUEUE_TAG: queue})
            run = self._instance.get_run_by_id(run.run_id)
            context = LaunchRunContext(dagster_run=run, workspace=context.workspace)
        super().launch_run(context)

    def _worker_answers(self, hostname: str) -> bool:
        replies = self.celery.control.ping(destination=[hostname], timeout=self.ping_timeout_s)
        return any(hostname in r for r in replies or [])

    def check_run_worker_health(self, run: dg.DagsterRun):
        result = super().check_run_worker_health(run)
        if result.status != WorkerStatus.RUNNING:
            return result
        task = self.celery.AsyncResult(run.tags[DAGSTER_CELERY_TASK_ID_TAG])
        info = task.info if isinstance(task.info, dict) else {}
        hostname = info.get("hostname")
        if not hostname or self._worker_answers(hostname):
            self._missed.pop(run.run_id, None)
            return result
        missed = self._missed.get(run.run_id, 0) + 1
        self._missed[run.run_id] = missed
        if missed < self.ping_misses:
            log.info("worker %s of run %s did not answer a ping (%d)", hostname, run.run_id, missed)
            return result
        self._missed.pop(run.run_id, None)
        return CheckRunHealthResult(
            WorkerStatus.FAILED,
            f"Celery worker {hostname} (pid {info.get('pid')}) did not answer {missed} pings: "
            "it is gone; the run's partitions will be retried on another worker",
        )

    def get_run_worker_debug_info(self, run, include_container_logs=True):
        base = "no task sent yet"
        if DAGSTER_CELERY_TASK_ID_TAG in run.tags:
            base = super().get_run_worker_debug_info(run, include_container_logs)
        queue = run.tags.get(DAGSTER_CELERY_QUEUE_TAG, self.default_queue)
        return (
            f"{base} queue={queue!r} (is a worker listening on it? `celery inspect active_queues`)"
        )
