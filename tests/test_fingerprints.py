"""Fingerprints and exact staleness, with the real parts: the CLI, a Dagster instance at
DAGSTER_HOME, the DuckDB catalog, the zoo encoders and the standing settings file
(FLOWMATCH_SETTINGS). One field of each stage's fingerprint is changed at a time; exactly the
expected asset partitions turn stale (in `flowmatch stale` and in the per-partition
``<asset>_fresh`` checks in Dagster), `materialize --stale` makes them fresh again, Dagster's own
staleness follows a re-made upstream through the data versions, and training refuses to mix
fingerprints within one kind."""

from __future__ import annotations

import json
import shutil

import dagster as dg
import pytest
import yaml
from dagster._utils.test.data_versions import get_stale_status_resolver

from flowmatch_assets import cli
from flowmatch_assets.defs.definitions import build_definitions
from flowmatch_assets.freshness.fingerprints import fresh_status
from flowmatch_models.data.agreement import FingerprintMismatchError
from flowmatch_models.data.module import EmbeddingDataModule
from flowmatch_models.storage.fingerprint import Fingerprint, diff, disagreement, folder_sha256
from flowmatch_models.storage.layout import DataLayout

PARTS = ["000-00", "001-00"]
KINDS = ["vae_latents", "dino_features", "text_embeddings"]
ALL = ["metadata", "images", *KINDS]


def _stale(capsys) -> dict[tuple[str, str], str]:
    capsys.readouterr()
    code = cli.main(["stale", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert code == (1 if rows else 0)
    return {(r["asset"], r["partition"]): r["reason"] for r in rows}


def _failed_checks() -> set[tuple[str, str]]:
    with dg.DagsterInstance.get() as instance:
        return {
            (a, p) for a in ALL for p, st in fresh_status(instance, a).items() if st == "FAILED"
        }


def _dagster_stale() -> set[tuple[str, str]]:
    """Asset partitions Dagster's own resolver calls stale (code versions, data versions)."""
    with dg.DagsterInstance.get() as instance:
        resolver = get_stale_status_resolver(instance, list(build_definitions().assets))
        return {
            (a, p)
            for a in ALL
            for p in PARTS
            if resolver.get_status(dg.AssetKey(a), p).value == "STALE"
        }


@pytest.fixture
def env(tmp_path, small_sample, zoo, monkeypatch):
    """The CLI's environment: a fresh DAGSTER_HOME and data root, the zoo encoders (the VAE a
    copy whose weights the test may change) and a settings file."""
    home, data = tmp_path / "home", tmp_path / "data"
    home.mkdir()
    vae = tmp_path / "vae"
    shutil.copytree(zoo["vae"], vae)
    settings = tmp_path / "settings.yaml"
    for k, v in {
        "DAGSTER_HOME": str(home),
        "FLOWMATCH_DATA_ROOT": str(data),
        "FLOWMATCH_METADATA": small_sample["metadata"],
        "FLOWMATCH_FILE_ROOT": small_sample["dest"],
        "FLOWMATCH_VAE": str(vae),
        "FLOWMATCH_DINO": zoo["dino"],
        "FLOWMATCH_TEXT": zoo["text"],
        "FLOWMATCH_SETTINGS": str(settings),
    }.items():
        monkeypatch.setenv(k, v)

    def settings_are(**over) -> None:
        base = {"encoders": {"batch_size": 8}, "ingest": {"threads": 4}}
        for k, v in over.items():
            base[k] = {**base.get(k, {}), **v}
        settings.write_text(yaml.safe_dump(base))

    settings_are()
    return {"data": data, "vae": vae, "settings_are": settings_are}


def test_one_changed_field_per_stage_marks_exactly_its_partitions_stale(
    env, capsys, tmp_path, small_sample, monkeypatch
):
    assert cli.main(["materialize"]) == 0
    assert _stale(capsys) == {}
    assert _failed_checks() == set()  # the <asset>_fresh checks ran with the materializations
    with dg.DagsterInstance.get() as instance:
        assert set(fresh_status(instance, "text_embeddings")) == set(PARTS)

    weights = next(env["vae"].glob("*.safetensors"))
    original = weights.read_bytes()

    def perturb_vae() -> None:  # other weights: the same model folder, another sha256
        from safetensors.numpy import load_file, save_file

        tensors = load_file(weights)
        name = sorted(tensors)[0]
        tensors[name] = tensors[name] + 1
        save_file(tensors, weights)

    cases = [
        # (what changes, how to undo it, exactly what turns stale, the reason it names)
        (
            lambda: env["settings_are"](encoders={"max_tokens": 16}),
            env["settings_are"],
            {"text_embeddings"},
            "max_tokens: 128 -> 16",
        ),
        (perturb_vae, lambda: weights.write_bytes(original), {"vae_latents"}, "weights_sha256: "),
        (
            lambda: env["settings_are"](encoders={"dino_pool": "resize112"}),
            env["settings_are"],
            {"dino_features"},
            "pooling: avg2x2 -> resize112",
        ),
        # the captions' encoder reads ids and captions only: the JPEG quality leaves it fresh
        (
            lambda: env["settings_are"](ingest={"quality": 80}),
            env["settings_are"],
            {"images", "vae_latents", "dino_features"},
            "quality: 95 -> 80",
        ),
        (
            lambda: env["settings_are"](ingest={"min_side": 300}),
            env["settings_are"],
            {"images", *KINDS},
            "min_side: 64 -> 300",
        ),
        (
            lambda: env["settings_are"](filters={"min_width": 300}),
            env["settings_are"],
            set(ALL),
            "filters.min_width: 256 -> 300",
        ),
    ]
    for change, undo, assets, reason in cases:
        change()
        found = _stale(capsys)
        expected = {(a, p) for a in assets for p in PARTS}
        assert set(found) == expected, (reason, found)
        first = min(assets, key=ALL.index)
        assert all(reason in found[(first, p)] for p in PARTS), found
        for a in assets - {first}:  # downstream partitions name their stale upstream
            assert all("upstream" in found[(a, p)] for p in PARTS), found
        assert _failed_checks() == expected  # `flowmatch stale` reported them to Dagster
        undo()
        assert _stale(capsys) == {}
        assert _failed_checks() == set()

    # the images and the text encoder change; images are re-made first: Dagster's own staleness
    # follows the new data version downstream, ours says the upstream was re-made
    env["settings_are"](ingest={"quality": 80}, encoders={"max_tokens": 16})
    assert _dagster_stale() == set()
    assert cli.main(["materialize", "--stale", "-a", "images"]) == 0
    found = _stale(capsys)
    assert set(found) == {(a, p) for a in KINDS for p in PARTS}
    assert "images was re-made with another fingerprint" in found[("vae_latents", "000-00")]
    assert found[("text_embeddings", "000-00")] == "max_tokens: 128 -> 16"  # not the images
    assert _dagster_stale() == {(a, p) for a in KINDS for p in PARTS}

    # training refuses to mix: only 000-00's text is re-made
    assert cli.main(["materialize", "--stale", "-p", "000-00"]) == 0
    assert (
        cli.main(
            ["materialize", "--stale", "-p", "001-00", "-a", "vae_latents", "-a", "dino_features"]
        )
        == 0
    )
    assert set(_stale(capsys)) == {("text_embeddings", "001-00")}
    with pytest.raises(FingerprintMismatchError) as e:
        EmbeddingDataModule(env["data"], batch_size=2)
    msg = str(e.value)
    assert msg.startswith("text_embeddings: partitions made with different settings")
    assert "000-00" in msg and "001-00" in msg and "max_tokens: 16 -> 128" in msg
    # growing at an epoch boundary: a newly complete partition made otherwise is skipped, said
    dm = EmbeddingDataModule(env["data"], partitions=["000-00"], batch_size=2, grow=True)
    dm.train_dataloader()
    assert dm.partitions == ["000-00"]
    assert "max_tokens: 16 -> 128" in dm.ledger[-1]["skipped"]["001-00"]

    # the stale set re-made: everything fresh, in `flowmatch stale`, the checks and Dagster
    assert cli.main(["materialize", "--stale"]) == 0
    assert _stale(capsys) == {}
    assert _failed_checks() == set()
    assert _dagster_stale() == set()
    EmbeddingDataModule(env["data"], batch_size=2)  # one fingerprint per kind again

    # the same settings, another stored row set: one image of 000-00 is gone when images is
    # re-made; every kind reads the rows (the caption kind: their ids and captions), so all three
    # turn stale, and a re-made images partition with the same rows leaves them fresh
    files = tmp_path / "files"
    shutil.copytree(small_sample["dest"], files)
    monkeypatch.setenv("FLOWMATCH_FILE_ROOT", str(files))
    assert cli.main(["materialize", "-p", "000-00", "-a", "images"]) == 0
    assert _stale(capsys) == {}
    import pyarrow.parquet as pq

    shard = DataLayout(env["data"]).asset_path("images", "000-00")
    first = pq.read_table(shard, columns=["id"]).column("id")[0].as_py()
    next((files / "images").glob(f"{first}.*")).unlink()
    assert cli.main(["materialize", "-p", "000-00", "-a", "images"]) == 0
    found = _stale(capsys)
    assert set(found) == {(a, "000-00") for a in KINDS}, found
    assert "images holds other captions since" in found[("text_embeddings", "000-00")]
    assert "images holds other ids since" in found[("vae_latents", "000-00")]


def test_fingerprint_fields_diff_and_disagreement(tmp_path):
    a = Fingerprint({"model": "m", "max_tokens": 128, "filters": {"min_width": 256}})
    b = Fingerprint({"model": "m", "max_tokens": 64, "filters": {"min_width": 300}}, {"up": "x"})
    assert a.hash != b.hash and len(a.hash) == 16
    assert Fingerprint.from_json(json.dumps(b.to_json())) == b
    assert diff(a.fields, b.fields) == ["filters.min_width: 256 -> 300", "max_tokens: 128 -> 64"]
    assert diff({"x": 1}, {"y": 1}) == ["x: 1 -> (none)", "y: (none) -> 1"]
    assert disagreement({"p1": a, "p2": a}) is None
    assert disagreement({"p1": None, "p2": None}) is None  # unknown: trainable together
    why = disagreement({"p1": a, "p2": a, "p3": b})
    assert "2 partitions (p1, p2)" in why and "1 (p3)" in why and "max_tokens: 128 -> 64" in why
    assert "made before fingerprints" in disagreement({"p1": a, "p2": None})
    # a model folder's hash: its files' names and bytes, remembered on disk for the next process
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "w.bin").write_bytes(b"1234")
    cache = tmp_path / "cache.json"
    h = folder_sha256(tmp_path / "m", cache)
    assert json.loads(cache.read_text()) == {next(iter(json.loads(cache.read_text()))): h}
    (tmp_path / "m" / "w.bin").write_bytes(b"1235")
    assert folder_sha256(tmp_path / "m", cache) != h


def test_exact_inputs_per_kind_and_fingerprints_from_before_them():
    """What each kind records as its inputs (issue 35): a caption kind the digest of the ids and
    captions it read, not the images' fingerprint; an image kind both. Row digests stay outside
    the hash (partitions of one source still share one), and a caption shard recorded before
    exact inputs (the images' hash as its input) trains beside one recorded since."""
    from flowmatch_models.data.agreement import agreeing
    from flowmatch_models.embeddings.kinds import KINDS as REGISTRY
    from flowmatch_models.embeddings.kinds import kind_fingerprint, kind_inputs
    from flowmatch_models.encoders.spec import EncoderSpec
    from flowmatch_models.storage.fingerprint import rows_digest

    ids, caps = ["a", "b"], ["a red disc", None]
    text, vae = REGISTRY["text_embeddings"], REGISTRY["vae_latents"]
    assert kind_inputs(text, {"images": "h1"}, ids, caps) == (
        {},
        {"captions": rows_digest(ids, caps)},
    )
    assert kind_inputs(vae, {"images": "h1"}, ids, caps) == (
        {"images": "h1"},
        {"ids": rows_digest(ids)},
    )
    assert rows_digest(ids, caps) != rows_digest(ids, ["a blue disc", None])
    assert rows_digest(ids) != rows_digest(["b", "a"])
    fp = kind_fingerprint(text, EncoderSpec(), {}).with_rows(captions=rows_digest(ids, caps))
    other = fp.with_rows(captions=rows_digest(["c"], ["x"]))
    assert fp.hash == other.hash and fp.rows != other.rows  # rows: outside the hash
    assert Fingerprint.from_json(fp.to_json()).rows == fp.rows
    old = Fingerprint(fp.fields, {"images": "h1"})  # recorded before exact inputs
    assert old.hash != fp.hash and "rows" not in old.to_json()
    assert agreeing("text_embeddings", old).hash == agreeing("text_embeddings", fp).hash
    assert agreeing("vae_latents", old) is old  # image kinds: the whole fingerprint
