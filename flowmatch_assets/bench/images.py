"""Image stage benchmark: flowmatch's ingest vs img2dataset 1.47, images per CPU-second.

Both download the same loopback URL list of PD12M-sized JPEGs (long side 1,000-3,000 px, varied
aspect, q90) and produce 256x256 centre crops encoded as JPEG q95. The HTTP server runs in its
own process so its CPU is charged to neither side.

- ours: ``ingest_rows`` in this process, 1 process x N threads; CPU = ``time.process_time``
  delta around the call (imports and setup excluded).
- img2dataset: its CLI from ``.bench/img2dataset-venv`` (``scripts/bench_images_env.sh``),
  ``--processes_count 1 --thread_count N``; CPU = ``getrusage(RUSAGE_CHILDREN)`` delta of the
  subprocess (it and its worker/logger processes). Its fixed cost (interpreter start, imports,
  process spawns) is measured by a run on a one-URL list and subtracted, so the ratio compares
  steady-state per-image work; the uncorrected numbers are reported too.

``--profile`` adds where our CPU goes: each step of the image stage timed on its own
(``time.process_time``, one thread, every corpus image fetched over the same loopback server),
in ms per image; ``entropy_floor`` is a 1/8-scale decode of the same files, which still
Huffman-decodes every coefficient: no libjpeg-turbo decode of these files costs less.

Usage: ``python -m flowmatch_assets.bench.images [--n 400] [--threads 16] [--profile]``.
The last line of output is one JSON object (``"bench": "images"``).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from flowmatch_assets.ingest import decode
from flowmatch_assets.ingest.batch import count_reasons, ingest_one, ingest_rows
from flowmatch_assets.ingest.fetch import fetch_bytes, make_pool
from flowmatch_assets.ingest.images import IngestConfig
from flowmatch_models.storage.atomic import atomic_write_bytes

CORPUS_VERSION = 1
_ASPECTS = (1.0, 5 / 4, 4 / 3, 3 / 2, 16 / 9, 2.0)

_SERVER = r"""
import functools, http.server, sys

class Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

srv = http.server.ThreadingHTTPServer(
    ("127.0.0.1", 0), functools.partial(Handler, directory=sys.argv[1])
)
srv.daemon_threads = True
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""

# img2dataset's own image step (``Resizer``: cv2 decode, INTER_AREA resize, crop, encode) and
# its full-size decode alone, timed on the corpus files in its virtualenv, one thread.
_I2D_STEPS = r"""
import io, json, sys, time
import cv2, numpy as np
from img2dataset.resizer import Resizer
cv2.setNumThreads(1)
datas = [open(p, "rb").read() for p in sys.argv[1:]]
resizer = Resizer(image_size=256, resize_mode="center_crop", resize_only_if_bigger=False)
def timed(fn):
    best = float("inf")
    for _ in range(3):
        c0 = time.process_time()
        for d in datas:
            fn(d)
        best = min(best, time.process_time() - c0)
    return round(1e3 * best / len(datas), 3)
print(json.dumps({
    "resizer": timed(lambda d: resizer(io.BytesIO(d))),
    "cv2_full_decode": timed(lambda d: cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_UNCHANGED)),
}))
"""

# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def make_photo(index: int) -> bytes:
    """A deterministic photo-like JPEG (q90).

    A smooth colour field with shapes, slightly blurred (optics), plus 1/f ("pink") texture
    summed over octaves (natural images have a roughly 1/f spectrum) and faint sensor noise.
    This lands at ~1-1.5 bits per pixel at q90; white noise instead would inflate the files
    and make JPEG entropy decoding, which no decoder can skip, dominate unrealistically.
    """
    rng = np.random.default_rng(CORPUS_VERSION * 1_000_003 + index)
    long_side = int(rng.integers(1000, 3001))
    aspect = float(rng.choice(_ASPECTS))
    w, h = long_side, max(1, round(long_side / aspect))
    if rng.random() < 0.35:
        w, h = h, w
    field = Image.fromarray(rng.integers(0, 256, (5, 7, 3), dtype=np.uint8), "RGB")
    im = field.resize((w, h), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(8, 20))):
        x0, x1 = sorted(rng.integers(0, w, 2).tolist())
        y0, y1 = sorted(rng.integers(0, h, 2).tolist())
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        kind = rng.integers(0, 3)
        if kind == 0:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        elif kind == 1:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
        else:
            draw.line((x0, y0, x1, y1), fill=colour, width=int(rng.integers(2, 30)))
    arr = np.asarray(im.filter(ImageFilter.GaussianBlur(1.0)), dtype=np.float32)
    tex = np.zeros((h, w), np.float32)
    for k in range(1, 7):
        s = 2**k
        octave = rng.standard_normal((h // s + 2, w // s + 2)).astype(np.float32)
        up = Image.fromarray(octave, "F").resize((w, h), Image.Resampling.BILINEAR)
        tex += np.asarray(up) * (12.0 * s**0.5 / 8)
    arr += tex[..., None]
    arr += rng.standard_normal((h, w, 1), dtype=np.float32)
    out = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")
    buf = io.BytesIO()
    out.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _write_photo(args: tuple[int, str]) -> int:
    index, path = args
    data = make_photo(index)
    atomic_write_bytes(path, data)
    return len(data)


def build_corpus(corpus_dir: Path, n: int, workers: int = 2) -> list[Path]:
    """Create (or reuse) ``n`` JPEGs under ``corpus_dir``; returns their paths in order."""
    img_dir = corpus_dir / f"v{CORPUS_VERSION}"
    img_dir.mkdir(parents=True, exist_ok=True)
    paths = [img_dir / f"{i:05d}.jpg" for i in range(n)]
    todo = [(i, str(p)) for i, p in enumerate(paths) if not p.exists()]
    if todo:
        print(f"building corpus: {len(todo)} images -> {img_dir}", flush=True)
        with ProcessPoolExecutor(max_workers=workers) as ex:
            for done, _ in enumerate(ex.map(_write_photo, todo, chunksize=4), start=1):
                if done % 50 == 0:
                    print(f"  {done}/{len(todo)}", flush=True)
    return paths


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


class StaticServer:
    """``http.server`` serving a folder from a separate process (its CPU is not measured)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    def __enter__(self) -> StaticServer:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(self.directory)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.isdigit():
            self.proc.kill()
            raise RuntimeError(f"benchmark HTTP server did not start (said {line!r})")
        self.port = int(line)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"


def run_ours(urls: list[str], threads: int) -> dict:
    """Ingest ``urls`` in this process; CPU from process_time."""
    cfg = IngestConfig(threads=threads, retries=0, allow_networks=["127.0.0.0/8"])  # loopback
    rows = [{"id": str(i), "url": u} for i, u in enumerate(urls)]
    w0, c0 = time.perf_counter(), time.process_time()
    results = ingest_rows(rows, cfg)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    counts = count_reasons(results)
    stored = counts.get("stored", 0)
    return {
        "stored": stored,
        "failures": {k: v for k, v in counts.items() if k != "stored"},
        "cpu_s": cpu,
        "wall_s": wall,
        "per_core": stored / cpu,
        "wall_per_s": stored / wall,
    }


def profile_stages(urls: list[str], reps: int = 3) -> dict[str, float]:
    """CPU ms per image of each step of our image stage, one thread, best of ``reps`` passes.

    ``row`` is one whole row as ``ingest_rows`` does it (``ingest_one``: fetch, md5, decode,
    crop, encode, result); ``http_fetch``, ``md5`` and ``process_image`` are its parts, and
    ``jpeg_header_checks`` ... ``encode`` the parts of ``process_image`` on the JPEG path (the
    same functions it calls, in its order). ``other`` is ``row`` less the three parts (thread
    pool, result, URL checks). ``entropy_floor`` is not a step: a 1/8-scale decode of the same
    bytes, which still Huffman-decodes every coefficient.
    """
    cfg = IngestConfig(threads=1, retries=0, allow_networks=["127.0.0.0/8"])  # loopback
    pool = make_pool(cfg)
    encoder = decode.ENCODERS[cfg.image_format.lower()]
    bodies = [fetch_bytes(u, cfg, pool) for u in urls]  # warm the pool and the server's cache

    def timed(fn: Callable, items: list) -> tuple[float, list]:
        best, out = float("inf"), []
        for _ in range(reps):
            c0 = time.process_time()
            out = [fn(x) for x in items]
            best = min(best, time.process_time() - c0)
        return 1e3 * best / len(items), out

    rows = [{"id": str(i), "url": u} for i, u in enumerate(urls)]
    prof = {
        "row": timed(lambda r: ingest_one(r, cfg, pool), rows)[0],
        "http_fetch": timed(lambda u: fetch_bytes(u, cfg, pool), urls)[0],
        "md5": timed(lambda b: hashlib.md5(b).hexdigest(), bodies)[0],
        "process_image": timed(lambda b: decode.process_image(b, cfg), bodies)[0],
    }
    plans = [decode.jpeg_plan(b, cfg) for b in bodies]
    if all(pl is not None for pl in plans):  # every corpus file takes the simplejpeg path
        prof["jpeg_header_checks"] = timed(lambda b: decode.jpeg_plan(b, cfg), bodies)[0]
        prof["dct_scaled_decode"], arrays = timed(
            lambda bp: decode.jpeg_decode_scaled(*bp), list(zip(bodies, plans))
        )
        prof["to_pillow"], ims = timed(lambda ap: decode.to_pillow(*ap), list(zip(arrays, plans)))
        del arrays
        jobs = [(im, pl.transpose, pl.target) for im, pl in zip(ims, plans)]
        del ims
        prof["crop_resize"], outs = timed(lambda job: decode.crop_resize(*job), jobs)
        del jobs
        prof["encode"] = timed(lambda o: decode.encode(o, cfg, encoder), outs)[0]
    prof["other"] = prof["row"] - prof["http_fetch"] - prof["md5"] - prof["process_image"]
    prof["entropy_floor"] = timed(
        lambda b: decode.simplejpeg.decode_jpeg(b, colorspace="GRAY", min_width=1, min_height=1),
        bodies,
    )[0]
    pool.clear()
    return {k: round(v, 3) for k, v in prof.items()}


def _img2dataset_once(exe: Path, url_file: Path, out_dir: Path, threads: int) -> dict:
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [
        str(exe),
        "--url_list",
        str(url_file),
        "--input_format",
        "txt",
        "--output_folder",
        str(out_dir),
        "--resize_mode",
        "center_crop",
        "--image_size",
        "256",
        "--output_format",
        "webdataset",
        "--processes_count",
        "1",
        "--thread_count",
        str(threads),
    ]
    env = dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1", WANDB_MODE="disabled")
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    w0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - w0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(
            f"img2dataset failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}"
        )
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    successes = 0
    failures: dict[str, int] = {}
    for stats in out_dir.glob("*_stats.json"):
        s = json.loads(stats.read_text())
        successes += int(s.get("successes", 0))
        for k, v in (s.get("status_dict") or {}).items():
            if k != "success":
                failures[k] = failures.get(k, 0) + int(v)
    return {"stored": successes, "failures": failures, "cpu_s": cpu, "wall_s": wall}


def profile_img2dataset(venv: Path, paths: list[Path]) -> dict[str, float]:
    """CPU ms per image of img2dataset's image step (its ``Resizer``) and of OpenCV's full
    decode within it, one thread, on the corpus files (no HTTP)."""
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _I2D_STEPS, *map(str, paths)],
        env=dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1"),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"img2dataset step profile failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_img2dataset(venv: Path, urls: list[str], work: Path, threads: int) -> dict:
    """Run img2dataset on ``urls`` and on a one-URL list (its fixed cost)."""
    exe = venv / "bin" / "img2dataset"
    if not exe.exists():
        raise FileNotFoundError(
            f"no img2dataset at {exe}; create the bench virtualenv with "
            "`scripts/bench_images_env.sh` (or pass --skip-img2dataset)"
        )
    work.mkdir(parents=True, exist_ok=True)
    one = work / "one_url.txt"
    one.write_text(urls[0] + "\n")
    full = work / "urls.txt"
    full.write_text("\n".join(urls) + "\n")
    base = _img2dataset_once(exe, one, work / "i2d-one", threads)
    res = _img2dataset_once(exe, full, work / "i2d-out", threads)
    stored = res["stored"]
    steady_cpu = res["cpu_s"] - base["cpu_s"]
    steady_wall = res["wall_s"] - base["wall_s"]
    res.update(
        fixed_cpu_s=base["cpu_s"],
        fixed_wall_s=base["wall_s"],
        per_core_raw=stored / res["cpu_s"],
        per_core=(stored - base["stored"]) / steady_cpu,
        wall_per_s_raw=stored / res["wall_s"],
        wall_per_s=(stored - base["stored"]) / steady_wall,
    )
    return res


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    """Build/reuse the corpus, serve it, run both sides, print a summary and one JSON line."""
    p = argparse.ArgumentParser(prog="python -m flowmatch_assets.bench.images", description=__doc__)
    p.add_argument("--n", type=int, default=400, help="corpus size (>= 300 for the record)")
    p.add_argument("--threads", type=int, default=16, help="threads per side (1 process each)")
    p.add_argument("--corpus-dir", type=Path, default=Path(".bench/images-corpus"))
    p.add_argument("--work-dir", type=Path, default=Path(".bench/images-run"))
    p.add_argument("--img2dataset-venv", type=Path, default=Path(".bench/img2dataset-venv"))
    p.add_argument("--skip-img2dataset", action="store_true", help="only measure our stage")
    p.add_argument(
        "--profile", action="store_true", help="also time each step of our stage (one thread)"
    )
    args = p.parse_args(argv)

    paths = build_corpus(args.corpus_dir, args.n)
    sizes = [pth.stat().st_size for pth in paths]
    dims = []
    for pth in paths[:50]:
        with Image.open(pth) as im:
            dims.append(im.size[0] * im.size[1])
    print(
        f"corpus: {len(paths)} JPEGs, mean {np.mean(sizes) / 1e6:.2f} MB, "
        f"mean {np.mean(dims) / 1e6:.1f} MP (first 50)",
        flush=True,
    )
    with StaticServer(paths[0].parent) as srv:
        urls = [srv.url(pth.name) for pth in paths]
        ours = run_ours(urls, args.threads)
        print(
            f"ours:        {ours['stored']}/{len(urls)} stored, {ours['cpu_s']:.2f} CPU-s, "
            f"{ours['wall_s']:.2f} s wall -> {ours['per_core']:.1f} img/CPU-s, "
            f"{ours['wall_per_s']:.1f} img/s wall",
            flush=True,
        )
        theirs = None
        if not args.skip_img2dataset:
            theirs = run_img2dataset(args.img2dataset_venv, urls, args.work_dir, args.threads)
            print(
                f"img2dataset: {theirs['stored']}/{len(urls)} stored, {theirs['cpu_s']:.2f} CPU-s "
                f"(fixed {theirs['fixed_cpu_s']:.2f}), {theirs['wall_s']:.2f} s wall -> "
                f"{theirs['per_core']:.1f} img/CPU-s ({theirs['per_core_raw']:.1f} incl. fixed), "
                f"{theirs['wall_per_s']:.1f} img/s wall",
                flush=True,
            )
        profile = profile_stages(urls) if args.profile else None
        if profile:
            print("ours, CPU ms per image by step (one thread):", flush=True)
            for k, v in profile.items():
                print(f"  {k:20s} {v:7.3f}", flush=True)
        i2d_profile = None
        if args.profile and theirs:
            i2d_profile = profile_img2dataset(args.img2dataset_venv, paths)
            i2d_profile["steady_per_image"] = round(1e3 / theirs["per_core"], 3)
            print("img2dataset, CPU ms per image (one thread; steady = the run above):", flush=True)
            for k, v in i2d_profile.items():
                print(f"  {k:20s} {v:7.3f}", flush=True)

    result: dict = {
        "bench": "images",
        "ours_per_core": round(ours["per_core"], 2),
        "img2dataset_per_core": round(theirs["per_core"], 2) if theirs else None,
        "ratio": round(ours["per_core"] / theirs["per_core"], 2) if theirs else None,
        "ratio_incl_fixed": round(ours["per_core"] / theirs["per_core_raw"], 2) if theirs else None,
        "ours_wall_per_s": round(ours["wall_per_s"], 2),
        "img2dataset_wall_per_s": round(theirs["wall_per_s"], 2) if theirs else None,
        "ours_stored": ours["stored"],
        "img2dataset_stored": theirs["stored"] if theirs else None,
        "ours_failures": ours["failures"],
        "img2dataset_failures": theirs["failures"] if theirs else None,
        "n_urls": len(paths),
        "threads": args.threads,
        "corpus_mean_bytes": int(np.mean(sizes)),
        "cpu_count": os.cpu_count(),
    }
    if profile:
        result["profile_ms_per_image"] = profile
        result["ours_steady_ms_per_image"] = round(1e3 / ours["per_core"], 3)
    if i2d_profile:
        result["img2dataset_profile_ms_per_image"] = i2d_profile
    if theirs and theirs["stored"] != ours["stored"]:
        print(
            f"note: success counts differ (ours {ours['stored']}, img2dataset {theirs['stored']})"
        )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
