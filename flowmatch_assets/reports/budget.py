"""The seeds' cost arithmetic, automated (no Dagster; the only I/O is reading the catalog).

From throughput measured in the DuckDB catalog, project what the whole PD12M (12.4M pairs) and
N gradient updates at effective batch B cost in hours, cloud dollars, owned-box energy and disk,
beside the seeds' published figures.

Honesty rules, enforced here:

* Nothing is invented. A stage without a measurement gets a row that says "not measured";
  measured rates are never scaled by a GPU count (linear scaling is an assumption, not a
  measurement), ``gpus`` only multiplies the *price* of a GPU-hour.
* Rates are grouped by the device they ran on, never averaged across devices: a CPU rate on a
  shared dev box is not a GPU rate, and each row names its device.
* Precalc pairs/s: the embedding kinds (flowmatch_models.embeddings: ``vae_latents``,
  ``dino_features``, ``text_embeddings`` and any registered since) are produced by one step that
  runs the encoders one after the other on one device, and each records only its own encoder
  time. So a pair costs the *sum* of the kinds' seconds; ``max`` would pretend they ran in
  parallel. Only partitions that have every kind are counted; shard read/write time is not in
  these seconds.
* Training samples/s: a resumed run's ``flow_model`` record carries the run's *cumulative*
  samples but only the last session's wall seconds, so samples/seconds can be wildly high. The
  run's steady rate (``extra.samples_per_s``: the median of the samples/s windows the Lightning
  module logged, without the first and last window, see :func:`steady_rate`; the same number
  as the catalog's ``throughput`` and the asset's metadata) is used when present; otherwise
  samples/seconds, labelled as such. Per (device, preset) the latest run counts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import BaseModel, Field

from flowmatch_assets.catalog import PD12M_PAIRS, Catalog, format_table
from flowmatch_assets.reports.removed import removed_cost, removed_rows, render_removed
from flowmatch_models.embeddings.kinds import EMBEDDING_ASSETS
from flowmatch_models.storage.atomic import atomic_write_text

#: The seeds' published figures (shared/context/seed-flow-matching-on-a-budget.txt).
SEED_PRECALC_PAIRS_S = 200.0  # 2x RTX 3090, both fully used
SEED_UPDATES_S = 0.39  # 2x RTX 3090, effective batch 1024 (3.1 batches/s of 64 per GPU, accum 8)
SEED_BATCH = 1024
SEED_GPUS = 2
SEED_BOX_WATTS = 1000.0  # "just under 700 W ... round up to 1 kW"
SEED_IMAGES_GB = 650.0  # PD12M at 256 px
SEED_EMBEDDINGS_GB = 700.0  # fp16 + xz, 128-token text
REPA_UPDATES_S = 5.4  # REPA paper, 8x H100
REPA_GPUS = 8
REPA_QUOTE = "seed: ~164 GPU-h, ~$440 a run (400k updates at $2.76)"

STAGES = ("images", "precalc", "training")


class BudgetConfig(BaseModel):
    """Targets and prices of the projection (all editable in the launchpad and on the CLI)."""

    dataset_pairs: int = Field(default=PD12M_PAIRS, description="Pairs to prepare (PD12M 12.4M).")
    updates: int = Field(default=300_000, description="Gradient updates (REPA needs 200-400k).")
    effective_batch: int = Field(default=1024, description="Samples per gradient update.")
    gpu_hour_usd: float = Field(
        default=2.76, description="Cloud price of one GPU-hour (seed: Lambda H100 $2.76)."
    )
    gpus: int = Field(
        default=1,
        description="GPUs billed per hour for our GPU-measured rates (the rates are NOT scaled).",
    )
    cpu_hour_usd: float = Field(
        default=0.10, description="Cloud price of a CPU box hour, for CPU-measured rates."
    )
    box_watts: float = Field(default=1000.0, description="Owned box draw at load (seed: ~1 kW).")
    kwh_usd: float = Field(default=0.32, description="Electricity $/kWh (seed: ~0.25 GBP).")
    hardware_usd: float | None = Field(
        default=None, description="Owned box purchase price (seed: ~2500); None skips payback."
    )
    ssd_tb: float = Field(
        default=1.0, description="The SSD that holds the embeddings and checkpoints, in TB."
    )
    max_tokens: int = Field(
        default=128, description="Caption tokens stored at most (the worst case on the SSD)."
    )

    def validate_targets(self) -> None:
        """Raise ValueError on targets that make no sense (zero batch, negative prices...)."""
        for name in ("dataset_pairs", "updates", "effective_batch", "gpus"):
            if getattr(self, name) <= 0:
                raise ValueError(f"budget: {name} must be > 0, got {getattr(self, name)}")
        for name in ("gpu_hour_usd", "cpu_hour_usd", "box_watts", "kwh_usd", "ssd_tb"):
            if getattr(self, name) < 0:
                raise ValueError(f"budget: {name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Rate:
    """One measured rate: ``per_s`` samples (images, pairs, training samples) per second."""

    stage: str
    per_s: float
    device: str
    samples: int
    seconds: float
    count: int  # partitions (images, precalc) or runs (training)
    note: str = ""


def is_gpu(device: str) -> bool:
    """Whether a device label names a GPU (``cuda``, ``cuda:0``, ``cuda (NVIDIA H200)``...)."""
    d = device.lower()
    return "cuda" in d or "gpu" in d or "rocm" in d


def _images(catalog: Catalog) -> list[Rate]:
    rows = catalog.query(
        """SELECT coalesce(device, 'unknown device') AS d, sum(samples) AS n,
                  sum(seconds) AS s, count(*) AS k
           FROM materializations WHERE asset = 'images' AND seconds > 0
           GROUP BY 1 HAVING sum(samples) > 0 ORDER BY 1"""
    )
    return [
        Rate("images", r["n"] / r["s"], r["d"], int(r["n"]), float(r["s"]), int(r["k"]))
        for r in rows
    ]


def _precalc(catalog: Catalog) -> list[Rate]:
    emb = ", ".join(f"'{a}'" for a in EMBEDDING_ASSETS)
    rows = catalog.query(
        f"""WITH p AS (
              SELECT partition, coalesce(any_value(device), 'unknown device') AS d,
                     min(samples) AS n, sum(seconds) AS s, count(DISTINCT asset) AS k,
                     bool_or(coalesce(TRY_CAST(json_extract(extra, '$.random_weights')
                                               AS BOOLEAN), false)) AS zoo
              FROM materializations WHERE asset IN ({emb}) GROUP BY partition)
            SELECT d, sum(n) AS n, sum(s) AS s, count(*) AS k, bool_or(zoo) AS zoo
            FROM p WHERE k = {len(EMBEDDING_ASSETS)} AND s > 0 AND n > 0
            GROUP BY d ORDER BY d"""
    )
    kinds = catalog.query(
        f"""SELECT coalesce(device, 'unknown device') AS d, asset, sum(samples) AS n,
                  sum(seconds) AS s,
                  bool_or(coalesce(TRY_CAST(json_extract(extra, '$.random_weights')
                                            AS BOOLEAN), false)) AS zoo,
                  any_value(coalesce(json_extract_string(extra, '$.weights'), '')) AS weights
           FROM materializations WHERE asset IN ({emb}) AND seconds > 0 AND samples > 0
           GROUP BY d, asset ORDER BY d, asset"""
    )
    out = []
    for r in rows:
        note = f"sum of the {len(EMBEDDING_ASSETS)} encoders' seconds"
        if r["zoo"]:
            note += "; RANDOM-WEIGHT zoo encoders, not the real models' cost"
        per = [
            f"{k['asset']} {k['n'] / k['s']:,.1f}/s"
            + (f" ({k['weights'].split(':')[0]})" if k["weights"] else "")
            for k in kinds
            if k["d"] == r["d"]
        ]
        if per:  # each encoder's own rate: a real model's is a real cost on this device
            note += "; per encoder on " + r["d"] + ": " + ", ".join(per)
        out.append(
            Rate("precalc", r["n"] / r["s"], r["d"], int(r["n"]), float(r["s"]), int(r["k"]), note)
        )
    return out


def steady_rate(rates: list[float]) -> float | None:
    """The median of a run's logged samples/s windows, without the first (start-up, compile,
    first batches) and, from 3 windows on, the last (it often holds the final checkpoint and
    sample grid): one slow window moves a median by at most one rank. None without windows."""
    xs = [float(x) for x in rates if x is not None and float(x) > 0]
    if len(xs) >= 3:
        xs = xs[1:-1]
    elif len(xs) == 2:
        xs = xs[1:]
    if not xs:
        return None
    xs.sort()
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def logged_rates(metrics_csv: str | Path) -> list[float]:
    """The ``train/samples_per_s`` column of a Lightning CSVLogger ``metrics.csv``, in order."""
    import csv

    out = []
    with open(metrics_csv, newline="") as f:
        for r in csv.DictReader(f):
            v = r.get("train/samples_per_s")
            if v not in (None, ""):
                out.append(float(v))
    return out


def _training(catalog: Catalog) -> list[Rate]:
    rows = catalog.query(
        """SELECT coalesce(device, 'unknown device') AS d,
                  coalesce(json_extract_string(extra, '$.preset'), '?') AS preset,
                  partition, samples, seconds,
                  TRY_CAST(json_extract(extra, '$.samples_per_s') AS DOUBLE) AS sps, written_at
           FROM materializations WHERE asset = 'flow_model' ORDER BY written_at"""
    )
    latest: dict[tuple[str, str], dict] = {}
    runs: dict[tuple[str, str], int] = {}
    for r in rows:
        key = (r["d"], r["preset"])
        runs[key] = runs.get(key, 0) + 1
        latest[key] = r  # ordered by written_at: the last one wins
    out = []
    for (device, preset), r in sorted(latest.items()):
        n, s = int(r["samples"] or 0), float(r["seconds"] or 0.0)
        if r["sps"] and r["sps"] > 0:
            per_s, how = float(r["sps"]), "median samples/s over the run's steady logged windows"
        elif n > 0 and s > 0:
            per_s, how = n / s, "samples / wall s (incl. startup; too high if resumed)"
        else:
            continue
        note = f"run {r['partition']}, preset {preset}; {how}"
        out.append(Rate("training", per_s, device, n, s, runs[(device, preset)], note))
    return out


def _bytes_per_sample(catalog: Catalog) -> dict[str, dict]:
    rows = catalog.query(
        "SELECT asset, codec, samples, stored_bytes_per_sample AS b, tokens, token_row_bytes "
        "FROM compression"
    )
    return {
        r["asset"]: {
            "bytes": float(r["b"]),
            "codec": r["codec"],
            "samples": int(r["samples"]),
            "tokens": r["tokens"],
            "token_row_bytes": r["token_row_bytes"],
        }
        for r in rows
        if r["b"]
    }


def measure(catalog: Catalog) -> dict:
    """Everything measured: ``{"images"|"precalc"|"training": [Rate, ...], "bytes": {...}}``.

    One Rate per device (training: per device and preset, latest run); an empty list where a
    stage was never measured. ``bytes`` maps asset -> stored bytes per sample and codec.
    """
    return {
        "images": _images(catalog),
        "precalc": _precalc(catalog),
        "training": _training(catalog),
        "bytes": _bytes_per_sample(catalog),
    }


def _row(
    stage: str,
    source: str,
    rate: str,
    device: str,
    hours: float | None,
    cloud_per_h: float | None,
    cfg: BudgetConfig,
    watts: float | None = None,
    note: str = "",
) -> dict:
    kwh = None if hours is None or watts is None else hours * watts / 1000
    return {
        "stage": stage,
        "source": source,
        "rate": rate,
        "device": device,
        "hours": hours,
        "cloud_usd": None if hours is None or cloud_per_h is None else hours * cloud_per_h,
        "box_kwh": kwh,
        "box_usd": None if kwh is None else kwh * cfg.kwh_usd,
        "note": note,
    }


def project(measured: dict, cfg: BudgetConfig) -> list[dict]:
    """Rows per stage: ours (one per measured device) then the seeds' references.

    Each row: stage, source, rate, device, hours, cloud_usd, box_kwh, box_usd, note (None where
    there is nothing measured to project from).
    """
    cfg.validate_targets()
    P, U, B = cfg.dataset_pairs, cfg.updates, cfg.effective_batch
    label = {
        "images": f"images: {P:,} images",
        "precalc": f"precalc: {P:,} pairs",
        "training": f"training: {U:,} updates x {B:,}",
    }

    def price(device: str) -> float:
        return cfg.gpu_hour_usd * cfg.gpus if is_gpu(device) else cfg.cpu_hour_usd

    rows: list[dict] = []
    for stage in STAGES:
        rates: list[Rate] = measured.get(stage) or []
        if not rates:
            rows.append(_row(label[stage], "ours", "not measured", "-", None, None, cfg))
        for r in rates:
            if stage == "training":
                ups = r.per_s / B
                hours, txt = U / ups / 3600, f"{ups:.4g} updates/s ({r.per_s:,.1f} samples/s)"
            else:
                unit = "images/s" if stage == "images" else "pairs/s"
                hours, txt = P / r.per_s / 3600, f"{r.per_s:,.1f} {unit}"
            what = "partition" if stage != "training" else "run"
            what += "" if r.count == 1 else "s"
            note = f"{r.samples:,} samples in {r.seconds:,.0f} s over {r.count} {what}"
            note += f"; {r.note}" if r.note else ""
            rows.append(
                _row(
                    label[stage],
                    "ours",
                    txt,
                    r.device,
                    hours,
                    price(r.device),
                    cfg,
                    cfg.box_watts,
                    note,
                )
            )
    seed, seed_dev = "seed (2x RTX 3090)", "2x RTX 3090"
    seed_ups = SEED_UPDATES_S * SEED_BATCH / B  # same samples/s, at our batch
    rows.append(
        _row(
            label["precalc"],
            seed,
            f"{SEED_PRECALC_PAIRS_S:g} pairs/s",
            seed_dev,
            P / SEED_PRECALC_PAIRS_S / 3600,
            cfg.gpu_hour_usd * SEED_GPUS,
            cfg,
            SEED_BOX_WATTS,
            "seed: ~17 h for PD12M",
        )
    )
    rows.append(
        _row(
            label["training"],
            seed,
            f"{seed_ups:.4g} updates/s",
            seed_dev,
            U / seed_ups / 3600,
            cfg.gpu_hour_usd * SEED_GPUS,
            cfg,
            SEED_BOX_WATTS,
            f"seed: {SEED_UPDATES_S} updates/s at batch {SEED_BATCH} (~33k/day)",
        )
    )
    rows.append(
        _row(
            label["training"],
            "REPA paper (8x H100)",
            f"{REPA_UPDATES_S:g} updates/s",
            "8x H100",
            U / REPA_UPDATES_S / 3600,
            cfg.gpu_hour_usd * REPA_GPUS,
            cfg,
            None,
            f"as quoted, at REPA's own batch; {REPA_QUOTE}",
        )
    )
    return rows


def project_disk(measured: dict, cfg: BudgetConfig) -> list[dict]:
    """Disk for ``dataset_pairs``: stored bytes per sample (catalog ``compression``) x pairs:
    images (HDD), then each embedding kind and their total (SSD), the checkpoints, and whether
    embeddings + checkpoints fit ``ssd_tb`` as measured and in the worst case (every caption at
    ``max_tokens`` tokens: the stored bytes of a token are fixed); then the seed's figures."""
    per = measured.get("bytes") or {}
    out = []
    images = per.get("images")
    out.append(
        {
            "what": "images (HDD)",
            "bytes_per_sample": images and images["bytes"],
            "gb": images and images["bytes"] * cfg.dataset_pairs / 1e9,
            "note": f"images {images['codec'] or '?'}; from {images['samples']:,} samples"
            if images
            else "not measured: images",
        }
    )
    missing = [a for a in EMBEDDING_ASSETS if a not in per]
    total = worst = 0.0
    for a in EMBEDDING_ASSETS:
        if a not in per:
            continue
        m = per[a]
        b, note = m["bytes"], f"{m['codec'] or '?'}; from {m['samples']:,} samples"
        bw = b
        if m.get("tokens") and m.get("token_row_bytes"):
            mean = m["tokens"] / m["samples"]
            bw = b + (cfg.max_tokens - mean) * m["token_row_bytes"]
            note += (
                f"; {mean:.1f} tokens/caption measured x {m['token_row_bytes']:,.0f} B; "
                f"{cfg.max_tokens} tokens each: {bw:,.0f} B/sample, "
                f"{bw * cfg.dataset_pairs / 1e9:,.0f} GB"
            )
        total, worst = total + b, worst + bw
        out.append(
            {
                "what": f"  {a} (SSD)",
                "bytes_per_sample": b,
                "gb": b * cfg.dataset_pairs / 1e9,
                "note": note,
            }
        )
    if missing:
        out.append(
            {
                "what": "embeddings (SSD)",
                "bytes_per_sample": None,
                "gb": None,
                "note": f"not measured: {', '.join(missing)}",
            }
        )
    else:
        out.append(
            {
                "what": "embeddings (SSD)",
                "bytes_per_sample": total,
                "gb": total * cfg.dataset_pairs / 1e9,
                "note": f"every kind; {worst * cfg.dataset_pairs / 1e9:,.0f} GB if every "
                f"caption had {cfg.max_tokens} tokens",
            }
        )
    ckpt = checkpoint_row(cfg)
    out.append(ckpt)
    if not missing:
        out.append(
            ssd_fit(
                total * cfg.dataset_pairs / 1e9,
                worst * cfg.dataset_pairs / 1e9,
                ckpt["gb"],
                cfg.ssd_tb,
            )
        )
    for what, gb in (
        ("seed: images 256 px", SEED_IMAGES_GB),
        ("seed: embeddings", SEED_EMBEDDINGS_GB),
    ):
        out.append(
            {
                "what": what,
                "bytes_per_sample": gb * 1e9 / PD12M_PAIRS,
                "gb": gb * cfg.dataset_pairs / PD12M_PAIRS,
                "note": "seed, for PD12M, scaled",
            }
        )
    return out


def ssd_fit(embeddings_gb: float, worst_gb: float, checkpoints_gb: float, ssd_tb: float) -> dict:
    """Whether embeddings + checkpoints fit an SSD of ``ssd_tb`` TB, as measured and at worst."""
    cap = ssd_tb * 1000
    need, need_worst = embeddings_gb + checkpoints_gb, worst_gb + checkpoints_gb
    fits, fits_worst = need <= cap, need_worst <= cap
    verdict = (
        f"fits: {cap - need:,.0f} GB left" if fits else f"does NOT fit: {need - cap:,.0f} GB short"
    )
    verdict += "; at 128-token captions " + (
        f"fits too ({cap - need_worst:,.0f} GB left)"
        if fits_worst
        else f"{need_worst - cap:,.0f} GB short"
    )
    if not fits:
        verdict += (
            "; store the text and DINO arrays lossy (EncoderSpec.lossy: pca4.5/pca4, "
            "the default) or plan a larger SSD"
        )
    return {
        "what": f"SSD {ssd_tb:g} TB: embeddings + checkpoints",
        "bytes_per_sample": None,
        "gb": need,
        "note": verdict,
        "fits": fits,
        "fits_worst_case": fits_worst,
    }


#: Parameter counts of the DiT presets (flowmatch_models/model/dit.py), recorded so that the budget
#: needs no torch: ``{"key": <dit.py + diffusers>, "counts": {"<preset>/<projector_hidden>":
#: [params, transformer params]}}``. Re-record: ``python -m flowmatch_assets.reports.budget``
#: (tests/test_budget.py fails when it is out of date; a stale table is computed at run time).
PARAM_COUNTS = Path(__file__).with_name("param_counts.json")


def _param_key() -> str:
    """What the presets' parameter counts depend on: dit.py's source and diffusers' version."""
    import hashlib
    import importlib.metadata
    import importlib.util

    origin = importlib.util.find_spec("flowmatch_models.model.dit").origin
    h = hashlib.sha256(Path(origin).read_bytes())
    h.update(importlib.metadata.version("diffusers").encode())
    return h.hexdigest()[:16]


def count_params_of(preset: str, projector_hidden: int | None) -> tuple[int, int]:
    """(every parameter, the transformer's) of a freshly built ``preset`` (on the meta device)."""
    import torch

    from flowmatch_models.model.dit import build_model, count_params

    with torch.device("meta"):
        model = build_model(preset, projector_hidden=projector_hidden)
    return count_params(model), count_params(model.transformer)


def param_counts(preset: str, projector_hidden: int | None) -> tuple[int, int]:
    """The recorded counts (:data:`PARAM_COUNTS`) when they are current, else computed."""
    try:
        table = json.loads(PARAM_COUNTS.read_text())
        if table["key"] == _param_key():
            return tuple(table["counts"][f"{preset}/{projector_hidden}"])  # type: ignore[return-value]
    except (OSError, ValueError, KeyError):
        pass
    return count_params_of(preset, projector_hidden)


def record_param_counts(configs: Sequence[str | Path] = ()) -> dict:
    """Write :data:`PARAM_COUNTS` for the model of every config in ``configs`` (default every
    ``configs/*.yaml``)."""
    from flowmatch_models.train.config import load_config

    paths = list(configs) or sorted(
        (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")
    )
    counts = {}
    for p in paths:
        m = load_config(p).model
        counts[f"{m.preset}/{m.projector_hidden}"] = list(
            count_params_of(m.preset, m.projector_hidden)
        )
    table = {"key": _param_key(), "counts": dict(sorted(counts.items()))}
    atomic_write_text(PARAM_COUNTS, json.dumps(table, indent=1) + "\n")
    return table


def checkpoint_row(cfg: BudgetConfig) -> dict:
    """Checkpoints of a run of ``updates`` steps with configs/base.yaml's retention (full
    states + EMA snapshots, the arithmetic of
    :func:`flowmatch_models.train.config.checkpoint_disk_plan`), priced with the base preset's
    real parameter counts (:func:`param_counts`: no torch import when they are recorded)."""
    from flowmatch_models.train.config import checkpoint_disk_plan, load_config

    base = load_config(Path(__file__).resolve().parents[2] / "configs" / "base.yaml")
    base.trainer.max_steps = cfg.updates
    params, transformer = param_counts(base.model.preset, base.model.projector_hidden)
    plan = checkpoint_disk_plan(base, params, transformer)
    t = base.trainer
    note = (
        f"base.yaml: {plan['ema_snapshots_kept']} EMA snapshots (every {t.checkpoint_every:,}) "
        f"x {plan['ema_snapshot_bytes'] / 1e9:.2f} GB + {plan['full_states_kept']} full states "
        f"x {plan['full_state_bytes'] / 1e9:.2f} GB; last.ckpt a link"
    )
    return {
        "what": f"checkpoints (SSD, {cfg.updates:,} updates)",
        "bytes_per_sample": None,
        "gb": plan["total_bytes"] / 1e9,
        "note": note,
    }


#: ``flowmatch bench checkpoint``'s raw numbers (the stall per full state, old and new writer)
CHECKPOINT_BENCH = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "checkpoint.json"


def fault_row(measured: dict, cfg: BudgetConfig) -> dict:
    """What one fault (a crash, a power cut, a preemption without warning) costs the configured
    run (configs/base.yaml): the work since the newest full state, on average half the interval
    between full states and at worst all of it, on every GPU of the run; and the training
    loop's stall per hour for writing them (:mod:`flowmatch_models.train.state_writer`, the
    stall per state measured by ``flowmatch bench checkpoint``). A signal (SIGTERM, SIGUSR1)
    loses nothing: the state is saved at the next step (docs/training.md)."""
    from flowmatch_models.train.config import load_config

    base = load_config(Path(__file__).resolve().parents[2] / "configs" / "base.yaml")
    t = base.trainer
    gpus = int(t.devices) * int(t.num_nodes) if str(t.devices).isdigit() else 1
    gpu_rates = [r for r in measured["training"] if is_gpu(r.device)]
    if gpu_rates:
        r = max(gpu_rates, key=lambda r: r.per_s)
        ups, rate_src = r.per_s / cfg.effective_batch, f"measured on {r.device}"
    else:
        ups, rate_src = SEED_UPDATES_S, "the seed's 2x RTX 3090 rate (no GPU run measured)"
    step_s = (t.full_every / ups) if t.full_every else float("inf")
    clock_s = 60.0 * t.full_every_minutes if t.full_every_minutes else float("inf")
    interval_s = min(step_s, clock_s)
    stall = old = None
    if CHECKPOINT_BENCH.is_file():
        bench = json.loads(CHECKPOINT_BENCH.read_text())
        stall, old = bench["new"]["stall_s"], bench["old"]["stall_s"]
    per_hour = 3600.0 / interval_s if interval_s < float("inf") else 0.0
    return {
        "interval_minutes": interval_s / 60,
        "interval_from": "full_every_minutes" if clock_s <= step_s else "full_every steps",
        "updates_per_s": ups,
        "rate_source": rate_src,
        "gpus": gpus,
        "expected_lost_gpu_hours": gpus * interval_s / 2 / 3600,
        "worst_lost_gpu_hours": gpus * interval_s / 3600,
        "states_per_hour": per_hour,
        "stall_s_per_state": stall,
        "stall_s_per_hour": None if stall is None else stall * per_hour,
        "old_stall_s_per_hour": None if old is None else old * per_hour,
    }


def render_faults(f: dict) -> str:
    """The fault section of the report: lost GPU time per fault and the checkpoint stall."""
    stall = (
        f"{f['stall_s_per_hour']:.1f} s of stall per hour ({f['states_per_hour']:.1f} full "
        f"states x {f['stall_s_per_state']:.2f} s; the synchronous writer before: "
        f"{f['old_stall_s_per_hour']:.0f} s)"
        if f["stall_s_per_hour"] is not None
        else "stall per state not measured (flowmatch bench checkpoint)"
    )
    return (
        f"\n## Faults\n\nconfigs/base.yaml saves a full state every "
        f"{f['interval_minutes']:.0f} minutes ({f['interval_from']}; {f['updates_per_s']:.3g} "
        f"updates/s, {f['rate_source']}). One fault (crash, power cut, preemption without "
        f"warning) loses {f['expected_lost_gpu_hours']:.2f} GPU-hours expected, "
        f"{f['worst_lost_gpu_hours']:.2f} at worst ({f['gpus']} GPUs x half / all of the "
        f"interval); a signal (SIGTERM, SIGINT, SIGUSR1) loses nothing. Checkpoint stall: "
        f"{stall}.\n"
    )


def payback_hours(cfg: BudgetConfig) -> float | None:
    """Hours of use after which an owned box (hardware + power) is cheaper than ``gpus`` cloud
    GPUs; None without ``hardware_usd`` or if power costs as much as the cloud."""
    if cfg.hardware_usd is None:
        return None
    saving = cfg.gpu_hour_usd * cfg.gpus - cfg.box_watts / 1000 * cfg.kwh_usd
    return cfg.hardware_usd / saving if saving > 0 else None


def _num(v: float | None, fmt: str) -> str | None:
    return None if v is None else fmt.format(v)


def render_markdown(rows: list[dict], disk_rows: list[dict], cfg: BudgetConfig) -> str:
    """The report as markdown: targets and prices, the stage table, the disk table."""
    table = [
        {
            "stage": r["stage"],
            "source": r["source"],
            "rate": r["rate"],
            "measured on": r["device"],
            "hours": _num(r["hours"], "{:,.1f}"),
            "cloud $": _num(r["cloud_usd"], "${:,.0f}"),
            "owned box kWh": _num(r["box_kwh"], "{:,.0f}"),
            "owned box $": _num(r["box_usd"], "${:,.0f}"),
            "note": r["note"],
        }
        for r in rows
    ]
    dtable = [
        {
            "storage": d["what"],
            "bytes/sample": _num(d["bytes_per_sample"], "{:,.0f}"),
            f"for {cfg.dataset_pairs:,} pairs": _num(d["gb"], "{:,.0f} GB"),
            "note": d["note"],
        }
        for d in disk_rows
    ]
    head = (
        f"# Budget: {cfg.dataset_pairs:,} pairs, {cfg.updates:,} updates at batch "
        f"{cfg.effective_batch:,}\n\n"
        f"Cloud: ${cfg.gpu_hour_usd:g}/GPU-hour x {cfg.gpus} GPU(s) for GPU-measured rates, "
        f"${cfg.cpu_hour_usd:g}/hour for CPU-measured ones (one GPU price for every GPU model, "
        f"also in the reference rows). Owned box: {cfg.box_watts:g} W at "
        f"${cfg.kwh_usd:g}/kWh (seed rows: {SEED_BOX_WATTS:g} W). Our rates are measured by this "
        "pipeline on the device named and are not scaled: a CPU rate is not a GPU rate.\n"
    )
    pb = payback_hours(cfg)
    if cfg.hardware_usd is not None:
        head += f"\nOwned box ${cfg.hardware_usd:,.0f}: " + (
            f"cheaper than the cloud after {pb:,.0f} hours ({pb / 24:,.1f} days) of use.\n"
            if pb is not None
            else "never cheaper than the cloud at these prices.\n"
        )
    return head + "\n" + format_table(table) + "\n\n## Disk\n\n" + format_table(dtable) + "\n"


def _gpu_rates(measured: dict, cfg: BudgetConfig) -> list[tuple[str, str, str, float, int]]:
    """Per stage the GPU-measured rates ``(stage, "ours", device, samples/s, GPUs billed)``,
    else the seed's (what the removed samples are priced at)."""
    out = []
    seed = {"precalc": SEED_PRECALC_PAIRS_S, "training": SEED_UPDATES_S * SEED_BATCH}
    for stage in ("precalc", "training"):
        ours = [r for r in measured.get(stage) or [] if is_gpu(r.device)]
        out += [(stage, "ours", r.device, r.per_s, cfg.gpus) for r in ours]
        if not ours:
            out.append((stage, "seed (2x RTX 3090)", "2x RTX 3090", seed[stage], SEED_GPUS))
    return out


def budget(catalog: Catalog, cfg: BudgetConfig) -> tuple[str, dict]:
    """Measure, project and render: ``(markdown, json-able data)``."""
    measured = measure(catalog)
    rows, disk_rows = project(measured, cfg), project_disk(measured, cfg)
    faults = fault_row(measured, cfg)
    removed = removed_cost(_gpu_rates(measured, cfg), cfg, *removed_rows(catalog))
    data = {
        "config": cfg.model_dump(),
        "measured": {
            **{s: [asdict(r) for r in measured[s]] for s in STAGES},
            "bytes": measured["bytes"],
        },
        "projection": rows,
        "disk": disk_rows,
        "payback_hours": payback_hours(cfg),
        "faults": faults,
        "removed": removed,
    }
    json.dumps(data)  # fail here, not in a caller, if something is not serialisable
    md = render_markdown(rows, disk_rows, cfg) + render_faults(faults)
    return md + render_removed(removed, cfg.dataset_pairs), data


if __name__ == "__main__":
    print(json.dumps(record_param_counts(), indent=1))
