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
from dataclasses import asdict

from pydantic import BaseModel, Field

from flowmatch_assets.catalog import PD12M_PAIRS, Catalog, format_table
from flowmatch_assets.reports.faults import checkpoint_row, fault_row, render_faults
from flowmatch_assets.reports.measured import Rate, is_gpu, measure
from flowmatch_assets.reports.removed import removed_cost, removed_rows, render_removed
from flowmatch_models.embeddings.kinds import EMBEDDING_ASSETS

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
    faults = fault_row(measured, cfg, SEED_UPDATES_S)
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
