"""The demo sample's planted near-duplicates (issue 48 item 5): its copies (re-encoded at
quality 40, resized 0.5x and back, cropped 4%, a 10-px border) are appended after every other
row, so the rest of the sample is row for row the one before them, and at the demo's threshold
the pHash of the images as the images stage stores them finds exactly the copies (precision and
recall 1) and no unrelated image of the sample; at the default threshold the hash alone also
removes unrelated pictures with the same shape at the same place in another colour, which the
colour check keeps."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from flowmatch_assets.demo.dataset import NEAR_COPIES, NEAR_THRESHOLD, SampleSpec, write_sample
from flowmatch_assets.ingest import neardup
from flowmatch_assets.ingest.decode import process_image
from flowmatch_assets.ingest.images import IngestConfig
from flowmatch_assets.ingest.neardup_colour import colour_difference
from flowmatch_assets.ingest.neardup_index import HashIndex, decide_block
from flowmatch_models.data.order import heldout_rows

#: sha256 of every row of the default sample as written before the copies were planted (each
#: metadata file's name + the row as sorted JSON; the ``hash`` column covers the image bytes)
SAMPLE_BEFORE = "01ca149885027af03de3a9bfb6ce82fb7e5c2c07f7407dd68e3373a4e92807fb"


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> tuple[dict, list[list[dict]]]:
    """The demo's own sample (the default spec, as `flowmatch demo` writes it) and its rows
    per metadata file."""
    s = write_sample(tmp_path_factory.mktemp("demo") / "sample", SampleSpec())
    files = sorted(Path(s["metadata"]).glob("*.parquet"))
    return s, [pq.read_table(f).to_pylist() for f in files]


def test_the_copies_follow_every_other_row_and_leave_the_sample_as_it_was(sample):
    s, files = sample
    near = s["near_copies"]
    assert len(near) == len(NEAR_COPIES) == 5
    tail = files[-1][-len(near) :]
    assert [r["id"] for r in tail] == list(near)  # the last rows of the last file, in order
    h = hashlib.sha256()
    for n, rows in enumerate(files):
        for r in rows:
            if r["id"] not in near:
                h.update((f"pd12m.{n:03d}.parquet" + json.dumps(r, sort_keys=True) + "\n").encode())
    assert h.hexdigest() == SAMPLE_BEFORE
    by_id = {r["id"]: r for rows in files for r in rows}
    others = [r for r in by_id.values() if r["id"] not in near]
    for copy_id, original_id in near.items():
        c, o = by_id[copy_id], by_id[original_id]
        assert s["expected_outcomes"][copy_id] == s["expected_outcomes"][original_id] == "stored"
        assert c["caption"] == o["caption"]
        with Image.open(Path(s["dest"]) / o["url"].removeprefix("file:")) as im:
            assert (o["mime_type"], im.mode) == ("image/jpeg", "RGB")  # a colour JPEG
        assert c["hash"] not in {r["hash"] for r in others}  # the exact-hash dedupe keeps it
        assert c["url"] != o["url"] and c["source"] != o["source"]
    # the held-out rows of every partition (configs/tiny.yaml: 10%, at most 50) stay the same
    for rows in files:
        ids = [r["id"] for r in rows]
        kept = [i for i in ids if i not in near]
        assert [ids[k] for k in heldout_rows(ids, 0.1, 50)] == [
            kept[k] for k in heldout_rows(kept, 0.1, 50)
        ]
    # a spec that does not draw every source plants nothing (test_dedupe's draws one of them)
    small = write_sample(Path(s["dest"]).parent / "small", SampleSpec(files=3, rows_per_file=5))
    assert small["near_copies"] == {}


def test_the_detector_finds_the_planted_copies_and_nothing_else(sample):
    s, files = sample
    near = s["near_copies"]
    cfg, ids, stored = IngestConfig(), [], []
    root = Path(s["dest"])
    for rows in files:  # dataset order, as the decision walks it
        for r in rows:
            if s["expected_outcomes"][r["id"]] != "stored":
                continue
            data, _, _ = process_image((root / r["url"].removeprefix("file:")).read_bytes(), cfg)
            ids.append(r["id"])
            stored.append(data)
    h, c = neardup.signatures(stored)
    assert len(h) == 288 + 5
    winner, dist = neardup.decide(h, NEAR_THRESHOLD, c)  # the default colour tolerance
    found = {ids[i]: ids[winner[i]] for i in np.flatnonzero(winner >= 0)}
    assert found == near  # precision 1, recall 1, each against its own original
    # the margin: every copy within 2 bits, every other pair of the sample 6 bits or more apart
    pos = {i: k for k, i in enumerate(ids)}
    assert max(int(dist[pos[c]]) for c in near) <= 2
    d = neardup.hamming(h[:, None], h[None, :])
    copy_rows = [pos[c] for c in near]
    d[copy_rows, :] = 64  # the copies take no part
    d[:, copy_rows] = 64
    np.fill_diagonal(d, 64)
    assert int(d.min()) == 6 > NEAR_THRESHOLD
    # at the default threshold the hash alone (colour tolerance 255: every colour agrees)
    # removes the sample's unrelated look-alikes too (why the demo uses 4)
    w10, _ = neardup.decide(h, neardup.DEFAULT_THRESHOLD, c, 255)
    assert int((w10 >= 0).sum()) - len(near) == 9
    # they are the same shape at the same place in another colour (a white and a yellow ring
    # on navy): their colour signatures lie far beyond the tolerance, the copies' well within
    # (measured: 10 pairs within 10 bits, 19 to 82 apart; copies 3.25 at most)
    tol = neardup.DEFAULT_COLOUR_TOLERANCE
    i, j = np.nonzero(np.triu(d <= neardup.DEFAULT_THRESHOLD, 1))
    assert len(i) == 10, d[i, j].tolist()
    assert colour_difference(c[i], c[j]).min() > 1.5 * tol
    copies = colour_difference(c[copy_rows], c[[pos[near[x]] for x in near]])
    assert copies.max() <= 0.5 * tol, copies.tolist()
    # so with the colour check the default threshold finds exactly the copies as well, by brute
    # force and by the kept decision's index alike
    w, _ = neardup.decide(h, neardup.DEFAULT_THRESHOLD, c, tol)
    assert {ids[k]: ids[w[k]] for k in np.flatnonzero(w >= 0)} == near
    w, _ = decide_block(HashIndex(neardup.DEFAULT_THRESHOLD, tol), h, c)  # an empty index:
    assert {ids[k]: ids[-2 - w[k]] for k in np.flatnonzero(w <= -2)} == near  # -2 - j: row j
    assert (w >= 0).sum() == 0


def test_the_sample_is_the_same_in_any_process_state(tmp_path):
    """Two samples of one spec in one process, with Pillow's C rand() drawn between them (its
    effect_noise made the sample's grain, so a second sample, e.g. in the full test suite,
    came out with other bytes than `flowmatch demo`'s: CI saw another digest), are byte for
    byte the same."""
    spec = SampleSpec(files=2, rows_per_file=4)
    a = write_sample(tmp_path / "a", spec)
    Image.effect_noise((64, 64), 40)  # moves the C library's rand() state
    b = write_sample(tmp_path / "b", spec)

    def files(s):
        root = Path(s["dest"])
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*.*")}

    fa, fb = files(a), files(b)
    assert len(fa) >= 2 * 4 + 2 and fa.keys() == fb.keys()
    assert [k for k in fa if fa[k] != fb[k] and not k.endswith(".json")] == []
