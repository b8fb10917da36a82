"""The embedding store: exact codec round trips, lossy error bounds, integrity errors, ragged text."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flowmatch_models.storage.codecs import CODECS
from flowmatch_models.storage.lossy import lossy_error
from flowmatch_models.storage.store import (
    StoreError,
    pad_ragged,
    ragged_offsets,
    read_shard,
    write_shard,
)


def _smooth(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Correlated data (like real embeddings): a random walk along the last dim plus noise."""
    x = np.cumsum(rng.standard_normal(shape), axis=-1) * 0.1 + rng.standard_normal(shape) * 0.05
    return x.astype(np.float16)


@pytest.fixture()
def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=12).astype(np.int32)
    return {
        "latents": _smooth(rng, (12, 32, 8, 8)),
        "patch": _smooth(rng, (12, 64, 384)),
        "cls": _smooth(rng, (12, 384)),
        "tokens": _smooth(rng, (int(lengths.sum()), 640)),
        "lengths": lengths,
        "empty": np.zeros((0, 16), np.float16),
        "flags": rng.integers(0, 2, size=12).astype(bool),
        "big_endian": np.arange(12, dtype=">f4"),
        "f64": rng.standard_normal((12, 3)),
        "i64": rng.integers(-(2**40), 2**40, size=(12, 2)),
    }


IDS = [f"id-{i:03d}" for i in range(12)]


@pytest.mark.parametrize("codec", CODECS)
def test_codecs_roundtrip_exactly(tmp_path, arrays, codec):
    path = tmp_path / f"s-{codec}.fms"
    attrs = {"scaling_factor": 0.41407, "model": "dc-ae", "random_weights": True}
    stats = write_shard(path, arrays, IDS, codec=codec, attrs=attrs)
    assert stats.raw_bytes == sum(a.nbytes for a in arrays.values())
    assert stats.stored_bytes == path.stat().st_size
    shard = read_shard(path, verify=True)
    assert len(shard) == 12 and shard.ids == IDS
    assert shard.attrs == attrs
    assert shard.names == list(arrays)
    for name, a in arrays.items():
        got = shard[name]
        assert got.shape == a.shape
        assert got.dtype == a.dtype.newbyteorder("<")
        np.testing.assert_array_equal(got, a)
        assert not got.flags.writeable
        assert shard[name] is got  # cached
    if codec == "zstd":
        # byte-shuffled zstd beats raw on correlated fp16 data
        assert stats.arrays["patch"]["stored_bytes"] < stats.arrays["patch"]["raw_bytes"]


def test_none_codec_is_memory_mapped(tmp_path, arrays):
    path = tmp_path / "s.fms"
    write_shard(path, arrays, IDS, codec="none")
    shard = read_shard(path)
    patch = shard["patch"]
    whole = np.frombuffer(shard._mapped(), np.uint8)  # the file's one read-only mapping
    assert np.shares_memory(patch, whole) and not patch.flags.owndata
    offset = patch.__array_interface__["data"][0] - whole.__array_interface__["data"][0]
    assert offset % 64 == 0
    np.testing.assert_array_equal(patch, arrays["patch"])
    with pytest.raises(ValueError):
        patch[0, 0, 0] = 1.0


def test_missing_array_and_attrs_errors(tmp_path, arrays):
    path = tmp_path / "s.fms"
    write_shard(path, arrays, IDS)
    with pytest.raises(KeyError, match="no array 'nope'"):
        read_shard(path)["nope"]
    with pytest.raises(TypeError, match="JSON-serialisable"):
        write_shard(tmp_path / "t.fms", arrays, IDS, attrs={"x": object()})
    with pytest.raises(TypeError, match="numeric arrays"):
        write_shard(tmp_path / "t.fms", {"s": np.array(["a"], dtype=object)}, ["a"])
    with pytest.raises(ValueError, match="unknown codec"):
        write_shard(tmp_path / "t.fms", arrays, IDS, codec="gzip")
    assert not (tmp_path / "t.fms").exists()


@pytest.mark.parametrize("mode, min_cos, max_rms", [("int8", 0.999, 0.02), ("fp8", 0.995, 0.05)])
@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_lossy_error_within_bounds_and_recorded(tmp_path, arrays, mode, min_cos, max_rms, codec):
    path = tmp_path / "lossy.fms"
    stats = write_shard(path, arrays, IDS, codec=codec, lossy={"patch": mode, "tokens": mode})
    shard = read_shard(path, verify=True)
    assert shard.names == list(arrays)  # scale arrays are internal
    for name in ("patch", "tokens"):
        got = shard[name]
        assert got.dtype == np.float16 and got.shape == arrays[name].shape
        err = lossy_error(arrays[name], got)
        assert err["min_cosine"] >= min_cos, err
        assert err["rel_rms"] <= max_rms, err
        recorded = shard.attrs["lossy"][name]
        assert recorded["mode"] == mode
        assert recorded["min_cosine"] == pytest.approx(err["min_cosine"], abs=1e-6)
        assert stats.arrays[name]["lossy"]["rel_rms"] == pytest.approx(err["rel_rms"], rel=1e-6)
        assert stats.arrays[name]["stored_bytes"] < 0.6 * arrays[name].nbytes
    np.testing.assert_array_equal(shard["latents"], arrays["latents"])  # others lossless


def test_lossy_rejects_non_float(tmp_path, arrays):
    with pytest.raises(ValueError, match="float array"):
        write_shard(tmp_path / "x.fms", arrays, IDS, lossy={"lengths": "int8"})
    with pytest.raises(ValueError, match="lossy mode"):
        write_shard(tmp_path / "x.fms", arrays, IDS, lossy={"patch": "int4"})


def test_lossy_error_metrics():
    a = np.array([[1.0, 0.0], [0.0, 0.0]])
    assert lossy_error(a, a) == {"min_cosine": 1.0, "mean_cosine": 1.0, "rel_rms": 0.0}
    b = np.array([[0.0, 1.0], [0.0, 0.0]])
    e = lossy_error(a, b)
    assert e["min_cosine"] == pytest.approx(0.0) and e["rel_rms"] == pytest.approx(np.sqrt(2))


@pytest.mark.parametrize("codec", CODECS)
def test_truncated_file_names_the_file(tmp_path, arrays, codec):
    path = tmp_path / "trunc.fms"
    write_shard(path, arrays, IDS, codec=codec)
    data = path.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 20, 0):
        path.write_bytes(data[:cut])
        with pytest.raises(StoreError, match="trunc.fms.*truncated"):
            read_shard(path)


@pytest.mark.parametrize("codec", CODECS)
def test_flipped_byte_in_array_detected(tmp_path, arrays, codec):
    path = tmp_path / "flip.fms"
    write_shard(path, arrays, IDS, codec=codec)
    shard = read_shard(path)
    off = shard._data_start + shard.info("patch")["offset"] + 5
    data = bytearray(path.read_bytes())
    data[off] ^= 0x10
    path.write_bytes(bytes(data))
    shard = read_shard(path)  # header is fine: opening is cheap and succeeds
    np.testing.assert_array_equal(shard["cls"], arrays["cls"])
    with pytest.raises(StoreError, match="flip.fms.*checksum mismatch in array 'patch'"):
        shard["patch"]
    with pytest.raises(StoreError, match="flip.fms"):
        read_shard(path, verify=True)


def test_flipped_byte_in_header_and_bad_magic(tmp_path, arrays):
    path = tmp_path / "hdr.fms"
    write_shard(path, arrays, IDS)
    data = bytearray(path.read_bytes())
    data[40] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="hdr.fms.*header checksum"):
        read_shard(path)
    other = tmp_path / "not.fms"
    other.write_bytes(b"PK\x03\x04" + b"\x00" * 200)
    with pytest.raises(StoreError, match="not.fms.*bad magic"):
        read_shard(other)
    with pytest.raises(StoreError, match="missing.fms.*no such shard"):
        read_shard(tmp_path / "missing.fms")


def test_rewrite_is_atomic_replacement(tmp_path, arrays):
    path = tmp_path / "s.fms"
    write_shard(path, arrays, IDS)
    write_shard(path, {"cls": arrays["cls"][:3]}, IDS[:3], codec="xz")
    shard = read_shard(path, verify=True)
    assert shard.ids == IDS[:3] and shard.names == ["cls"]
    assert [p.name for p in tmp_path.iterdir()] == ["s.fms"]  # no temp files left


def test_ragged_text_roundtrip(tmp_path):
    rng = np.random.default_rng(1)
    lengths = np.array([3, 1, 5, 2], np.int32)
    tokens = rng.standard_normal((int(lengths.sum()), 8)).astype(np.float16)
    offsets = ragged_offsets(lengths)
    assert offsets.tolist() == [0, 3, 4, 9, 11]
    write_shard(tmp_path / "t.fms", {"tokens": tokens, "lengths": lengths}, list("abcd"))
    s = read_shard(tmp_path / "t.fms")
    padded, mask = pad_ragged(s["tokens"], s["lengths"], [2, 0, 1])
    assert padded.shape == (3, 5, 8) and padded.dtype == np.float16
    assert mask.sum(axis=1).tolist() == [5, 3, 1]
    np.testing.assert_array_equal(padded[0], tokens[4:9])
    np.testing.assert_array_equal(padded[1, :3], tokens[0:3])
    assert not padded[1, 3:].any() and not padded[2, 1:].any()
    padded, mask = pad_ragged(tokens, lengths, [2, 3], max_len=4, offsets=offsets)
    assert padded.shape == (2, 4, 8) and mask.tolist() == [[True] * 4, [True, True, False, False]]
    np.testing.assert_array_equal(padded[0], tokens[4:8])


# ------------------------------------------------------------------ transform coding (pcaB)


def _hidden_states(rng: np.random.Generator, rows: int, width: int = 640) -> np.ndarray:
    """Like a text encoder's states: a few huge-mean channels, a concentrated spectrum."""
    basis = rng.standard_normal((32, width)) * np.linspace(3, 0.2, 32)[:, None]
    x = rng.standard_normal((rows, 32)) @ basis + 0.05 * rng.standard_normal((rows, width))
    x[:, :3] += np.array([-39.0, 20.0, 11.0])  # Gemma-like offset channels
    return x.astype(np.float16)


@pytest.mark.parametrize("mode,bits", [("pca4", 4.0), ("pca4.5", 4.5), ("pca2", 2.0)])
def test_transform_coding_is_fixed_rate_and_records_its_error(tmp_path, mode, bits):
    from flowmatch_models.storage.transform import bits_of

    rng = np.random.default_rng(1)
    lengths = rng.integers(5, 60, 40).astype(np.int32)
    tokens = _hidden_states(rng, int(lengths.sum()))
    patch = _hidden_states(rng, 40 * 64, 384).reshape(40, 64, 384)
    ids = [f"s{i}" for i in range(40)]
    path = tmp_path / "t.fms"
    stats = write_shard(
        path,
        {"tokens": tokens, "lengths": lengths, "patch": patch},
        ids,
        codec="zstd",
        lossy={"tokens": mode, "patch": mode},
    )
    assert bits_of(mode) == bits
    shard = read_shard(path, verify=True)
    with pytest.raises(ValueError, match="'lengths' is zstd"):
        shard.stored_rows("lengths")  # compressed: not readable by row
    assert shard.names == ["tokens", "lengths", "patch"]  # codes and tables are internal
    for name, x in (("tokens", tokens), ("patch", patch)):
        info = shard.info(name)
        assert info["shape"] == list(x.shape) and info["dtype"] == np.dtype(np.float16).str
        coded = shard.coded(name)
        # fixed rate: every row costs the same bytes, at most `bits` per value
        assert coded.codes.shape == (*x.shape[:-1], coded.row_bytes)
        assert coded.codes.dtype == np.uint8 and coded.row_bytes * 8 <= bits * x.shape[-1]
        assert shard._entries[shard._entries[name]["aux"]["codes"]]["codec"] == "none"
        # the loader reads the codes' rows from the file: their layout, as stored
        dtype, shape, offset = shard.stored_rows(name)
        assert dtype == np.uint8 and shape == coded.codes.shape
        with open(path, "rb") as f:
            f.seek(offset + coded.row_bytes)
            assert f.read(coded.row_bytes) == coded.codes.reshape(-1, coded.row_bytes)[1].tobytes()
        # the recorded error is the error of what reading returns
        err = lossy_error(x, shard[name])
        rec = shard.attrs["lossy"][name]
        assert rec["mode"] == mode and rec["min_cosine"] == pytest.approx(err["min_cosine"])
        assert rec["rel_rms"] == pytest.approx(err["rel_rms"], rel=1e-6)
        assert stats.arrays[name]["row_bytes"] == coded.row_bytes
        # rows read from the codes decode to the same values as the whole array
        some = np.array([3, 0, len(coded.codes) - 1])
        np.testing.assert_allclose(
            coded.decode(coded.codes[some]), shard[name][some], rtol=2e-3, atol=2e-3
        )
    # this data lives on 32 axes: 4 bits per value keep it close; 2 bits a little less so
    floor = {"pca4": 0.9995, "pca4.5": 0.9995, "pca2": 0.99}[mode]
    assert shard.attrs["lossy"]["tokens"]["mean_cosine"] > floor


def test_transform_coding_of_few_rows_is_near_lossless_and_small(tmp_path):
    """A shard of few rows spans few axes: they get 8 bits, the rest none (small tables)."""
    rng = np.random.default_rng(2)
    tokens = rng.standard_normal((12, 640)).astype(np.float16)
    write_shard(tmp_path / "s.fms", {"tokens": tokens}, ["a"], lossy={"tokens": "pca4"})
    shard = read_shard(tmp_path / "s.fms")
    t = shard.coded("tokens").tables
    assert t.weight.shape[0] <= 11 and set(t.counts) >= {8} and t.counts[8] == t.weight.shape[0]
    assert lossy_error(tokens, shard["tokens"])["min_cosine"] > 0.9999


def test_transform_coding_refuses_non_finite_and_detects_corrupt_codes(tmp_path):
    bad = np.ones((10, 8), np.float16)
    bad[3, 2] = np.inf
    with pytest.raises(ValueError, match="finite"):
        write_shard(tmp_path / "b.fms", {"x": bad}, ["a"], lossy={"x": "pca4"})
    with pytest.raises(ValueError, match="in \\(0, 8\\]"):
        write_shard(tmp_path / "b.fms", {"x": bad}, ["a"], lossy={"x": "pca9"})
    with pytest.raises(ValueError, match="pcaB"):
        write_shard(tmp_path / "b.fms", {"x": bad}, ["a"], lossy={"x": "int4"})
    x = _hidden_states(np.random.default_rng(3), 200, 64)
    path = tmp_path / "c.fms"
    write_shard(path, {"x": x}, ["a"], lossy={"x": "pca4"})
    shard = read_shard(path)
    e = shard._entries[shard._entries["x"]["aux"]["codes"]]
    data = bytearray(path.read_bytes())
    data[shard._data_start + e["offset"] + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="checksum mismatch in array 'x.__codes__'"):
        read_shard(path, verify=True)
    with pytest.raises(StoreError, match="checksum"):
        read_shard(path)["x"]


def test_bench_store_runs_on_a_small_store(tmp_path, capsys) -> None:
    """`flowmatch bench store` end to end on 24 samples (MiniLM text states): it crashed at
    decode_batch (issue 35), and no test ran it. Every storage beats the seed's bytes, decodes
    faster, and the default storage's lossy error is the recorded one (the bench re-measures)."""
    from flowmatch_assets.bench import store

    r = store.main(["--n", "24", "--repeat", "1", "--text", "minilm"])
    assert r["bench"] == "store" and r["n"] == 24
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["default"]["bytes_per_sample"] == r["default"]["bytes_per_sample"]
    assert 0 < r["default"]["bytes_vs_seed"] < 0.8
    assert r["default"]["decode_speedup_vs_seed"] > 1
    assert r["default"]["cpu_float32_decode_samples_per_s"] > 0
    assert 0.95 < r["default"]["lossy_error"]["tokens"]["min_cosine"] < 1
