"""What the centre square cuts away that aspect-ratio buckets keep (issue 21).

The procedural sample in its ``sides`` layout (``SampleSpec(layout="sides")``: pictures of 1.3:1
to 2:1, landscape and portrait, a shape on the left/right or top/bottom at that end of the long
side, or in the centre; captions in the demo's grammar) goes through the pipeline twice, into two
data roots: ``metadata`` + ``images`` with ``ingest.buckets: square`` and with
``aspect`` (in-process Dagster runs on an ephemeral instance). The caption analyser
(``reports/caption_eval.analyse_image``) then reads every stored image and compares what it
sees with the image's caption:

- **object kept**: the largest palette-coloured shape in the stored image is the caption's
  colour (the caption-named object is still in the picture), counted over the images whose
  whole original shows the analyser that colour (the sample's greyscale and alpha-edged
  encodings hide it whatever the crop: counted as ``unreadable_originals``, not scored);
- **position / shape / all four right**: what a model trained on these pairs would be taught.

Per mode and per caption position (at the sides vs in the centre), with the mean share of each
original the crop kept and the latent tokens per image (DC-AE f32 cells; 64 for a square).

    .venv/bin/flowmatch bench crop                  # ~2 min: 3 x 96 pictures, two modes

``--checkpoint`` instead scores a trained model's caption following when it generates at the
square and at wide and tall buckets (``--sizes``), e.g. the demo's square-trained run:

    .venv/bin/flowmatch bench crop --checkpoint data/runs/demo/checkpoints/last.ckpt
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from flowmatch_models.storage.layout import DataLayout


def _original_shows_it(path: Path, colour: str) -> bool:
    """Does the analyser find the caption's colour in the whole original (long side 512)? The
    sample's greyscale and alpha-edged encodings lose or mask colours whatever the crop."""
    from PIL import Image

    from flowmatch_assets.reports.caption_eval import analyse_image

    with Image.open(path) as im:
        im = im.convert("RGB")
        im.thumbnail((512, 512))
        return analyse_image(np.asarray(im))["colour"] == colour


def stored_vs_captions(data_root: Path, partitions: Sequence[str], sample_dest: Path) -> list[dict]:
    """One record per stored image of ``partitions``: the caption's words, what the analyser
    sees in the stored image (and whether it sees the caption's colour in the whole original),
    its stored size and kept share."""
    import pyarrow.parquet as pq

    from flowmatch_assets.reports.caption_eval import analyse_image, parse_caption
    from flowmatch_models.storage.image_shard import decode

    out = []
    for p in partitions:
        for r in pq.read_table(Path(data_root) / "images" / f"{p}.parquet").to_pylist():
            want, got = parse_caption(r["caption"]), analyse_image(decode(r["image"]))
            original = Path(sample_dest) / r["url"].removeprefix("file:")
            out.append(
                {
                    "id": r["id"],
                    "at": "centre" if want["position"] == "centre" else "sides",
                    "original_readable": _original_shows_it(original, want["colour"]),
                    "kept_object": got["colour"] == want["colour"],
                    **{
                        f"{k}_right": got[k] == want[k]
                        for k in ("colour", "shape", "size", "position")
                    },
                    "tokens": (r["height"] // 32) * (r["width"] // 32),
                    "kept": r["kept"],
                }
            )
    return out


def summarise(records: list[dict]) -> dict:
    """Fractions per group (``all``, ``sides``, ``centre``) of the images whose original shows
    the caption's object to the analyser (the others are counted, not scored)."""
    readable = [r for r in records if r["original_readable"]]
    groups = {
        "all": readable,
        **{g: [r for r in readable if r["at"] == g] for g in ("sides", "centre")},
    }
    out: dict = {"unreadable_originals": len(records) - len(readable)}
    for name, rs in groups.items():
        if not rs:
            continue
        out[name] = {
            "images": len(rs),
            "object_kept": float(np.mean([r["kept_object"] for r in rs])),
            "position_right": float(np.mean([r["position_right"] for r in rs])),
            "shape_right": float(np.mean([r["shape_right"] for r in rs])),
            "all_four_right": float(
                np.mean(
                    [
                        all(r[f"{k}_right"] for k in ("colour", "shape", "size", "position"))
                        for r in rs
                    ]
                )
            ),
        }
    out["kept_share_mean"] = float(np.mean([r["kept"] for r in records]))
    out["tokens_mean"] = float(np.mean([r["tokens"] for r in records]))
    return out


def run(work: Path, files: int, rows: int, seed: int, threads: int = 2) -> dict:
    """Write the sides sample under ``work``, materialize it both ways, compare."""
    import dagster as dg

    from flowmatch_assets.defs.partitions import register_partitions
    from flowmatch_assets.defs.resources import FlowmatchResource
    from flowmatch_assets.demo.dataset import SampleSpec, write_sample
    from flowmatch_assets.ingest.images import IngestConfig
    from flowmatch_assets.runs import run_assets

    sample = write_sample(
        work / "sample",
        SampleSpec(
            files=files,
            rows_per_file=rows,
            seed=seed,
            bad_rows=False,
            layout="sides",
            near_copies=False,
        ),
    )
    keys = [f"{n:03d}-00" for n in range(files)]
    result: dict = {"bench": "crop", "files": files, "rows_per_file": rows, "seed": seed}
    for mode in ("square", "aspect"):
        res = FlowmatchResource(
            data_root=str(work / mode),
            metadata_source=sample["metadata"],
            shard_size=10_000,
            ingest=IngestConfig(file_root=sample["dest"], threads=threads, buckets=mode),
        )
        t0 = time.perf_counter()
        with dg.DagsterInstance.ephemeral() as inst:
            register_partitions(inst, res)
            for k in keys:
                r = run_assets(
                    ["metadata", "images"], k, res=res, dagster_instance=inst, steps=False
                )
                if not r.success:
                    raise RuntimeError(f"{mode} {k}: the pipeline failed")
        result[mode] = {
            **summarise(stored_vs_captions(work / mode, keys, Path(sample["dest"]))),
            "pipeline_s": round(time.perf_counter() - t0, 1),
        }
    sq, asp = result["square"]["sides"], result["aspect"]["sides"]
    result["sides_object_kept_aspect_vs_square"] = asp["object_kept"] / max(sq["object_kept"], 1e-9)
    result["sides_objects_the_square_removed"] = 1 - sq["object_kept"]
    result["sides_objects_the_buckets_removed"] = 1 - asp["object_kept"]
    return result


def train_both(
    work: Path,
    keys: Sequence[str],
    sample: dict,
    steps: int,
    batch: int,
    text_encoder: str,
    sizes: Sequence[str],
    n_prompts: int = 48,
    threads: int = 2,
) -> dict:
    """The A/B: the sides sample already in ``work/square`` and ``work/aspect`` (:func:`run`)
    gets its embeddings (the demo VAE, the zoo's random DINOv2, ``text_encoder``), a tiny DiT
    is trained on each for the same ``steps`` at the same ``batch`` (the buckets in chunks of
    ``batch``: every batch one bucket), and each is scored at every size of ``sizes``."""
    import dagster as dg
    import yaml

    from flowmatch_assets.defs.partitions import register_partitions
    from flowmatch_assets.defs.resources import FlowmatchResource
    from flowmatch_assets.demo import DEMO_VAE
    from flowmatch_assets.ingest.images import IngestConfig
    from flowmatch_assets.runs import run_assets
    from flowmatch_models.encoders.spec import EncoderSpec
    from flowmatch_models.encoders.zoo import create_zoo
    from flowmatch_models.train.run import TrainRequest, train

    repo = Path(__file__).resolve().parents[2]
    zoo = create_zoo(work / "zoo")
    text = text_encoder if Path(text_encoder).is_dir() else str(zoo["text"])
    enc = EncoderSpec(vae=str(DEMO_VAE), dino=str(zoo["dino"]), text=text, batch_size=32)
    out: dict = {"steps": steps, "batch": batch, "text_encoder": text}
    for mode in ("square", "aspect"):
        res = FlowmatchResource(
            data_root=str(work / mode),
            metadata_source=sample["metadata"],
            shard_size=10_000,
            ingest=IngestConfig(file_root=sample["dest"], threads=threads, buckets=mode),
            encoders=enc,
        )
        t0 = time.perf_counter()
        with dg.DagsterInstance.ephemeral() as inst:
            register_partitions(inst, res)
            for k in keys:
                r = run_assets(
                    ["vae_latents", "dino_features", "text_embeddings"],
                    k,
                    res=res,
                    dagster_instance=inst,
                    steps=False,
                )
                if not r.success:
                    raise RuntimeError(f"{mode} {k}: the embeddings failed")
        emb_s = time.perf_counter() - t0
        cfg = yaml.safe_load((repo / "configs" / "tiny.yaml").read_text())
        cfg["run"].update(out_dir=str(DataLayout(work).run_dir(mode)))
        cfg["data"].update(
            root=str(work / mode), batch_size=batch, bucket_chunk=batch, num_workers=0
        )
        cfg["trainer"].update(max_steps=steps, sample_every=0, checkpoint_every=steps)
        cfg["logging"].update(wandb=False)
        t0 = time.perf_counter()
        result = train(TrainRequest(config=cfg, resume="none"))
        ckpt = Path(result.run_dir) / "checkpoints" / "last.ckpt"
        print(
            f"{mode}: embeddings {emb_s:.0f}s, {steps} steps in {time.perf_counter() - t0:.0f}s",
            flush=True,
        )
        scored = evaluate_sizes(str(ckpt), text, str(DEMO_VAE), sizes, n_prompts)
        out[mode] = {
            "sizes": scored["sizes"],
            "embeddings_s": round(emb_s, 1),
            "train_s": round(result.wall_s, 1),
        }
    return out


def evaluate_sizes(
    checkpoint: str, text_encoder: str, vae: str, sizes: Sequence[str], n_prompts: int = 48
) -> dict:
    """Caption following of one checkpoint generated at each of ``sizes`` (``"224x320"``: a
    wide bucket takes landscape prompts, a tall one portrait; reports/evaluation.py)."""
    from flowmatch_assets.reports.evaluation import evaluate_checkpoint
    from flowmatch_models.data.buckets import parse

    out = {}
    for size in sizes:
        r = evaluate_checkpoint(checkpoint, text_encoder, vae, n_prompts, size=parse(size))
        out[size] = {k: round(v, 3) for k, v in r["accuracy"].items()}
        print(f"{size}: " + ", ".join(f"{k} {v:.2f}" for k, v in out[size].items()))
    return {"bench": "crop-eval", "checkpoint": str(checkpoint), "prompts": n_prompts, "sizes": out}


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="flowmatch bench crop", description=__doc__)
    p.add_argument("--files", type=int, default=3)
    p.add_argument("--rows", type=int, default=96, help="pictures per metadata file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="folder to work in (default: a temporary one)")
    p.add_argument(
        "--checkpoint",
        default=None,
        help="instead: score this checkpoint's caption following at --sizes",
    )
    p.add_argument("--text-encoder", default="data/zoo/gemma3-270m")
    p.add_argument("--vae", default=None, help="default: the committed demo VAE")
    p.add_argument("--sizes", nargs="+", default=["256x256", "224x320", "320x224", "192x384"])
    p.add_argument(
        "--train",
        type=int,
        default=0,
        metavar="STEPS",
        help="then the A/B: embeddings, a tiny DiT trained STEPS steps on each mode "
        "(same batch), each scored at --sizes",
    )
    p.add_argument("--batch", type=int, default=16, help="--train: batch size (and bucket chunk)")
    a = p.parse_args(argv)
    if a.checkpoint:
        from flowmatch_assets.demo import DEMO_VAE

        out = evaluate_sizes(a.checkpoint, a.text_encoder, a.vae or str(DEMO_VAE), a.sizes)
        print(json.dumps(out))
        return out
    with tempfile.TemporaryDirectory(prefix="bench-crop-") as tmp:
        work = Path(a.work) if a.work else Path(tmp)
        out = run(work, a.files, a.rows, a.seed)
        if a.train:
            sample = {"metadata": str(work / "sample" / "metadata"), "dest": str(work / "sample")}
            keys = [f"{n:03d}-00" for n in range(a.files)]
            out["ab"] = train_both(work, keys, sample, a.train, a.batch, a.text_encoder, a.sizes)
    print("| mode | group | images | object kept | position right | shape right | all four right |")
    print("|---|---|---|---|---|---|---|")
    for mode in ("square", "aspect"):
        for g in ("sides", "centre", "all"):
            s = out[mode][g]
            print(
                f"| {mode} | {g} | {s['images']} | {s['object_kept']:.3f} | {s['position_right']:.3f} "
                f"| {s['shape_right']:.3f} | {s['all_four_right']:.3f} |"
            )
    for mode in ("square", "aspect"):
        print(
            f"{mode}: mean share of the original kept {out[mode]['kept_share_mean']:.3f}, "
            f"latent tokens per image {out[mode]['tokens_mean']:.1f}"
        )
    if "ab" in out:
        print("\nthe A/B (same steps and batch; all four right / position right per size):")
        print("| trained on | " + " | ".join(a.sizes) + " |")
        print("|---|" + "---|" * len(a.sizes))
        for mode in ("square", "aspect"):
            cells = [out["ab"][mode]["sizes"][z] for z in a.sizes]
            print(
                f"| {mode} | "
                + " | ".join(
                    f"{c.get('all_four', 0):.2f} / {c.get('position', 0):.2f}" for c in cells
                )
                + " |"
            )
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
