"""Collect examples/out/*/metrics.json into the README's table and copy the figures:
``python examples/make_table.py examples/out`` writes examples/out/table.md, examples/figures/.
"""

import json
import shutil
import sys
from pathlib import Path

EXAMPLES = {
    "flow_matching": "Flow Matching",
    "nonequilibrium": "Sohl-Dickstein 2015",
    "ddpm": "DDPM",
}
DATA = ("swissroll", "moons", "8gaussians", "digits")


def f(x, nd=3):
    return "" if x is None else f"{x:.{nd}f}"


def main(out: Path) -> None:
    runs = {}
    for p in sorted(out.glob("*/metrics.json")):
        m = json.loads(p.read_text())
        runs[m["example"], m["data"]] = m
    rows = [
        "### 2-D (held-out: 2,000 points; 2,000 samples)",
        "",
        "| data | example | steps | train s | sampling steps | energy distance (Gaussian, floor) | NLL nats (Gaussian) |",
        "|---|---|---|---|---|---|---|",
    ]
    for d in DATA[:3]:
        for e, name in EXAMPLES.items():
            m = runs.get((e, d))
            if m is None:
                continue
            nll = m.get("nll_nats", m.get("nll_bound_nats"))
            kind = "exact" if "nll_nats" in m else "bound"
            rows.append(
                f"| {d} | {name} | {m['steps']:,} | {m['train_seconds']:.0f} | {m['sampling_steps']} | "
                f"{f(m['energy_distance'], 4)} ({f(m['energy_distance_gaussian'], 4)}, "
                f"{f(m['energy_distance_train_vs_heldout'], 4)}) | "
                f"{f(nll, 2)} {kind} ({f(m['nll_gaussian_nats'], 2)}) |"
            )
    rows += [
        "",
        "### digits (held-out: 360 real images; 1,000 class-conditional samples)",
        "",
        "| example | steps | train s | sampling steps | classifier acc. (Gaussian) | two-sample acc. (Gaussian, floor) | NN ratio (Gaussian) | energy distance (Gaussian) | bits/dim (Gaussian, pixel hist.) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e, name in EXAMPLES.items():
        m = runs.get((e, "digits"))
        if m is None:
            continue
        rows.append(
            f"| {name} | {m['steps']:,} | {m['train_seconds']:.0f} | {m['sampling_steps']} | "
            f"{f(m['classifier_accuracy'])} ({f(m['classifier_accuracy_gaussian'])}) | "
            f"{f(m['c2st_accuracy'])} ({f(m['c2st_accuracy_gaussian'])}, {f(m['c2st_accuracy_train'])}) | "
            f"{f(m['nn_ratio'], 2)} ({f(m['nn_ratio_gaussian'], 2)}) | "
            f"{f(m['energy_distance'], 4)} ({f(m['energy_distance_gaussian'], 4)}) | "
            f"{f(m['bits_per_dim'], 2)} ({f(m['bits_per_dim_gaussian'], 2)}, "
            f"{f(m['bits_per_dim_pixel_histogram'], 2)}) |"
        )
    fm = [runs[k] for k in runs if k[0] == "flow_matching"]
    if fm:
        rows += [
            "",
            "Flow Matching: energy distance against the number of Euler steps",
            "",
            "| data | 2 | 5 | 10 | 20 | 50 | 100 |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in fm:
            by = m["energy_distance_by_nfe"]
            cells = " | ".join(f(by[k], 4) for k in ("2", "5", "10", "20", "50"))
            rows.append(f"| {m['data']} | {cells} | {f(m['energy_distance'], 4)} |")
    (out / "table.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    figures = Path(__file__).parent / "figures"
    figures.mkdir(exist_ok=True)
    for (e, d), _ in sorted(runs.items()):
        src = out / f"{e}-{d}" / "samples.png"
        if src.exists():
            shutil.copy(src, figures / f"{e}-{d}.png")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/out"))
