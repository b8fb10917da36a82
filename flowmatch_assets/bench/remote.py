"""Benchmark: what a remote data root (``FLOWMATCH_REMOTE``) adds to a partition and to a verb.

Against SeaweedFS's real S3 gateway on loopback (started here, ``bench/seaweed.py``):

- upload and download MB/s of one large object (s3fs, as the remote uses it);
- the seconds a publish adds to an images partition and an embedding partition of PD12M's
  size (files of ``--images-mb`` and ``--embeddings-mb``: sha256 + upload + marker + journal),
  against the local-only publish of the same file (fsync + rename), and as a share of that
  partition's own time (``--images-partition-s``: ~24 GB of originals at 1 Gbps;
  ``--embeddings-partition-s``: one RTX 3090's precompute, ARCHITECTURE.md; the H200's 9 s too);
- a fetch on first read (download + sha256 + rename) of the embedding partition;
- the verbs' side at ``--partitions`` x 5 assets of records: a sync of the journal when nothing
  changed, and the first sync of an empty cache (every marker and record).

    flowmatch bench remote                       # PD12M sizes, 1,240 partitions
    flowmatch bench remote --partitions 100      # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ASSETS = ("metadata", "images", "vae_latents", "dino_features", "text_embeddings")


def _file(path: Path, mb: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(int(mb)):
            f.write(block)
    return path


def _local_publish(src: Path, target: Path) -> float:
    """The local-only path: a temp copy fsynced and renamed (what a publish costs today
    beyond writing the file, which both paths pay)."""
    t0 = time.perf_counter()
    with open(src, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(src, target)
    return time.perf_counter() - t0


def run(
    partitions: int,
    images_mb: float,
    embeddings_mb: float,
    images_partition_s: float,
    embeddings_partition_s: float,
) -> dict:
    from flowmatch_assets.bench.seaweed import make_bucket, seaweed_s3
    from flowmatch_models.storage import remote

    out: dict = {"bench": "remote", "partitions": partitions}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        with seaweed_s3(tmp / "seaweed") as s3:
            make_bucket(s3, "bench")
            os.environ.update(s3.env)
            os.environ[remote.REMOTE_ENV] = "s3://bench/run"
            a, b = tmp / "a", tmp / "b"
            ra, rb = remote.Remote("s3://bench/run", a), remote.Remote("s3://bench/run", b)
            # raw throughput of one large object
            big = _file(tmp / "big.bin", embeddings_mb)
            t0 = time.perf_counter()
            ra.fs.put(str(big), ra.key("raw", "big.bin"))
            up = time.perf_counter() - t0
            t0 = time.perf_counter()
            ra.fs.get(ra.key("raw", "big.bin"), str(tmp / "big.back"))
            down = time.perf_counter() - t0
            out["upload_MBps"] = round(embeddings_mb / up, 1)
            out["download_MBps"] = round(embeddings_mb / down, 1)
            (tmp / "big.back").unlink()
            # a publish of each kind of partition, against the local-only path
            for what, mb, part_s, asset in (
                ("images", images_mb, images_partition_s, "images"),
                ("embeddings", embeddings_mb, embeddings_partition_s, "vae_latents"),
            ):
                target = a / asset / f"000-00.{'parquet' if asset == 'images' else 'fms'}"
                target.parent.mkdir(parents=True, exist_ok=True)
                local = _local_publish(_file(tmp / f"l-{what}", mb), tmp / f"l-{what}.done")
                src = _file(target.with_name(f".tmp-{target.name}"), mb)
                t0 = time.perf_counter()
                ra.publish({target: src}, asset, "000-00")
                added = time.perf_counter() - t0
                os.replace(src, target)
                out[f"{what}_MB"] = mb
                out[f"{what}_local_publish_s"] = round(local, 3)
                out[f"{what}_remote_publish_s"] = round(added, 2)
                out[f"{what}_partition_s"] = part_s
                out[f"{what}_added_fraction"] = round(added / part_s, 4)
            out["embeddings_added_fraction_h200_9s"] = round(
                out["embeddings_remote_publish_s"] / 9.0, 3
            )
            rb.sync()
            t0 = time.perf_counter()
            remote.readable(b, "vae_latents", "000-00", b / "vae_latents" / "000-00.fms")
            out["embeddings_fetch_s"] = round(time.perf_counter() - t0, 2)
            # the verbs' side: markers and records of PD12M's partitions
            rec = tmp / "record.parquet"
            rec.write_bytes(os.urandom(3 << 10))  # a catalog record: a few KB
            keys = [f"{i // 10:03d}-{i % 10:02d}" for i in range(partitions)]

            def one(key: str) -> None:
                for asset in ASSETS:
                    t = a / "catalog" / "materializations" / asset / f"{key}.parquet"
                    t.parent.mkdir(parents=True, exist_ok=True)
                    tmp_rec = t.with_name(f".tmp-{key}-{asset}")
                    tmp_rec.write_bytes(rec.read_bytes())
                    ra.publish({t: tmp_rec}, asset, key)
                    os.replace(tmp_rec, t)

            t0 = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(one, keys))
            out["publish_records_s"] = round(time.perf_counter() - t0, 1)
            c = remote.Remote("s3://bench/run", tmp / "c")
            t0 = time.perf_counter()
            n = c.sync()
            out["first_sync_s"] = round(time.perf_counter() - t0, 1)
            out["first_sync_entries"] = n
            t0 = time.perf_counter()
            again = c.sync()
            out["unchanged_sync_s"] = round(time.perf_counter() - t0, 3)
            out["unchanged_sync_entries"] = again
            t0 = time.perf_counter()
            seen = len(remote.published(tmp / "c", "images"))
            out["published_listing_s"] = round(time.perf_counter() - t0, 3)
            out["published_images"] = seen
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="flowmatch bench remote", description=__doc__)
    p.add_argument("--partitions", type=int, default=1240)
    p.add_argument("--images-mb", type=float, default=150)
    p.add_argument("--embeddings-mb", type=float, default=620)
    p.add_argument("--images-partition-s", type=float, default=194)
    p.add_argument("--embeddings-partition-s", type=float, default=100)
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    res = run(
        a.partitions,
        a.images_mb,
        a.embeddings_mb,
        a.images_partition_s,
        a.embeddings_partition_s,
    )
    line = json.dumps(res)
    print(line)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return res
