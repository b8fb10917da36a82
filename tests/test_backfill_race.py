"""`missing_partitions` through the webserver when a materialization lands mid-answer.

Dagster's partition statuses are built from two reads, the materializations and then the
unfinished attempts (dagster/_core/storage/partition_status_cache.py): a materialization that
lands between them leaves its partition in neither list for that one answer. CI's e2e test once
read such an answer right as its backfill ended (001-00 "missing", its files and records all
there). The real webserver cannot be made to answer so on demand, so a loopback server gives the
answers here, in Dagster's own shape; the partitions on disk are a real synthetic data root
(`flowmatch bench scale`'s builder)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from flowmatch_assets.bench import scale
from flowmatch_assets.freshness import backfill
from flowmatch_models.storage.layout import DataLayout

KEYS = ["000-00", "000-01", "000-02"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("race")
    scale.build(root, len(KEYS), 4, log=lambda m: None, checks=False)
    return scale.instance_env(root)["FLOWMATCH_DATA_ROOT"]


def _answer(asset: str, materialized: list[str], materializing: list[str] = ()) -> dict:
    return {
        "assetKey": {"path": [asset]},
        "partitionKeysByDimension": [{"name": "shards", "partitionKeys": KEYS}],
        "assetPartitionStatuses": {
            "__typename": "DefaultPartitionStatuses",
            "materializedPartitions": materialized,
            "materializingPartitions": list(materializing),
        },
    }


class _Webserver:
    """Answers the partition-status query from ``answers`` in turn (the last one repeats)."""

    def __init__(self, answers: list[list[dict]]):
        self.answers, self.asked = answers, 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                nodes = outer.answers[min(outer.asked, len(outer.answers) - 1)]
                outer.asked += 1
                body = json.dumps({"data": {"assetNodes": nodes}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_a_partition_in_neither_list_with_its_files_present_is_asked_about_again(data_root):
    racing = [_answer("vae_latents", ["000-00", "000-02"])]  # 000-01 in neither list
    settled = [_answer("vae_latents", KEYS)]
    with _Webserver([racing, settled]) as web:
        assert backfill.missing_partitions(web.url, ["vae_latents"], data_root) == []
        assert web.asked == 2
    # in neither list twice: missing (a materialization Dagster does not have)
    with _Webserver([racing, racing]) as web:
        assert backfill.missing_partitions(web.url, ["vae_latents"], data_root) == ["000-01"]
        assert web.asked == 2
    # materializing in the second answer: in flight, not missing
    with _Webserver([racing, [_answer("vae_latents", ["000-00", "000-02"], ["000-01"])]]) as web:
        assert backfill.missing_partitions(web.url, ["vae_latents"], data_root) == []


def test_a_partition_in_neither_list_with_no_files_is_missing_on_the_first_answer(data_root):
    path = DataLayout(data_root).asset_path("vae_latents", "000-01")
    moved = path.with_name("moved")
    path.rename(moved)
    try:
        with _Webserver([[_answer("vae_latents", ["000-00", "000-02"])]]) as web:
            assert backfill.missing_partitions(web.url, ["vae_latents"], data_root) == ["000-01"]
            assert web.asked == 1  # nothing on disk to doubt: no second question
        # Dagster remembers it, the file is gone: missing, whatever the answers
        with _Webserver([[_answer("vae_latents", KEYS)]]) as web:
            assert backfill.missing_partitions(web.url, ["vae_latents"], data_root) == ["000-01"]
            assert web.asked == 1
    finally:
        moved.rename(path)
