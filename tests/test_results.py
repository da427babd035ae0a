"""Results schema: make_results / validate / save / load / merge and ResultsError."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from truncsens import results
from truncsens.divergences import METRICS
from truncsens.results import REQUIRED_ATTRS, ResultsError

WINDOWS = [1, 4, 16]


def attrs(**over):
    a = {
        "truncsens_version": "0.1.0", "model": "tiny", "model_revision": "", "tokenizer": "tiny", "dtype": "float32",
        "device": "cpu", "semantics": "reencode", "positions": "original", "n_sink": 0, "reference_context": 64,
        "corpus": "/data/c", "corpus_sha256": "ab" * 32, "domain": "code", "seed": 0,
        "created": "2025-01-01T00:00:00+00:00", "command": "truncsens measure",
    }
    a.update(over)
    return a


def metrics_for(n: int, W: int = 3, offset: float = 0.0, policies: int | None = None) -> dict[str, np.ndarray]:
    shape = (n, W) if policies is None else (policies, n, W)
    base = np.arange(np.prod(shape), dtype=np.float64).reshape(shape) / 100 + offset
    out = {m: base + i for i, m in enumerate(METRICS)}
    out["top1_agree"] = (np.arange(np.prod(shape)).reshape(shape) % 2).astype(np.int64)
    return out


def make(n=4, docs=None, positions=None, offset=0.0, **attr_over):
    docs = docs or [f"d{i // 2}" for i in range(n)]
    positions = positions if positions is not None else list(range(64, 64 + n))
    return results.make_results(metrics_for(n, offset=offset), "window", WINDOWS, docs, positions,
                                list(range(100, 100 + n)), attrs(**attr_over))


def test_make_results_schema():
    ds = make()
    assert dict(ds.sizes) == {"target": 4, "window": 3}
    assert ds["window"].values.tolist() == WINDOWS
    assert ds["window"].dtype == np.int64
    assert ds["doc"].values.tolist() == ["d0", "d0", "d1", "d1"]
    assert ds["position"].values.tolist() == [64, 65, 66, 67]
    assert ds["token_id"].values.tolist() == [100, 101, 102, 103]
    for m in METRICS:
        assert ds[m].dims == ("target", "window")
        assert ds[m].dtype == (np.int8 if m == "top1_agree" else np.float32)
    assert ds["tv"].values[1, 2] == np.float32(0.05)
    assert ds["kl"].values[0, 0] == np.float32(1.0)  # METRICS[1] gets offset 1
    assert ds["top1_agree"].values.tolist() == [[0, 1, 0], [1, 0, 1], [0, 1, 0], [1, 0, 1]]
    assert ds.attrs["log_base"] == "e"
    assert results.sweep_dim(ds) == "window"


def test_make_results_attr_conversion():
    ds = make(model_revision=None, n_sink=True, extra_path=__import__("pathlib").Path("/x/y"))
    assert ds.attrs["model_revision"] == ""
    assert ds.attrs["n_sink"] == 1 and isinstance(ds.attrs["n_sink"], int)
    assert ds.attrs["extra_path"] == "/x/y"


def test_make_results_errors():
    m = metrics_for(2)
    with pytest.raises(ResultsError, match="sweep dim must be one of"):
        results.make_results(m, "length", WINDOWS, ["a", "a"], [1, 2], [3, 4], attrs())
    bad = dict(m)
    del bad["js"]
    with pytest.raises(ResultsError, match="metric 'js' missing"):
        results.make_results(bad, "window", WINDOWS, ["a", "a"], [1, 2], [3, 4], attrs())
    a = attrs()
    del a["corpus_sha256"]
    with pytest.raises(ResultsError, match="attrs missing: corpus_sha256"):
        results.make_results(m, "window", WINDOWS, ["a", "a"], [1, 2], [3, 4], a)
    with pytest.raises(ResultsError, match="semantics='chunked' is not one of"):
        results.make_results(m, "window", WINDOWS, ["a", "a"], [1, 2], [3, 4], attrs(semantics="chunked"))
    with pytest.raises(ResultsError, match=r"window values must be unique, got \[1, 1, 4\]"):
        results.make_results(m, "window", [1, 1, 4], ["a", "a"], [1, 2], [3, 4], attrs())


def test_budget_sweep_with_policies():
    m = metrics_for(3, W=2, policies=2)
    ds = results.make_results(m, "budget", [8, 32], ["a", "b", "c"], [9, 10, 11], [1, 2, 3], attrs(),
                              policies=["suffix", "random"])
    assert ds["tv"].dims == ("policy", "target", "budget")
    assert ds["policy"].values.tolist() == ["suffix", "random"]
    assert results.sweep_dim(ds) == "budget"


def test_save_load_round_trip(tmp_path):
    ds = make()
    path = results.save(ds, tmp_path / "sub" / "r.nc")
    assert path == tmp_path / "sub" / "r.nc"
    assert not (tmp_path / "sub" / "r.nc.tmp").exists()
    back = results.load(path)
    xr.testing.assert_equal(back, ds)
    assert back["doc"].values.tolist() == ["d0", "d0", "d1", "d1"]
    assert back["top1_agree"].dtype == np.int8
    assert back["tv"].dtype == np.float32
    for k in REQUIRED_ATTRS + ("log_base",):
        assert back.attrs[k] == ds.attrs[k], k


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="results file not found"):
        results.load(tmp_path / "nope.nc")


def test_load_text_file_is_results_error(tmp_path):
    p = tmp_path / "notes.nc"
    p.write_text("this is not NetCDF\n")
    with pytest.raises(ResultsError, match="is not a NetCDF results file"):
        results.load(p)


def test_load_foreign_netcdf_is_results_error(tmp_path):
    p = tmp_path / "weather.nc"
    xr.Dataset({"temp": (("time",), np.arange(5.0))}, coords={"time": np.arange(5)}).to_netcdf(p, engine="h5netcdf")
    with pytest.raises(ResultsError, match="neither a 'window' nor a 'budget' dim"):
        results.load(p)


def test_load_file_missing_metric_or_attr(tmp_path):
    ds = make()
    p = tmp_path / "m.nc"
    ds.drop_vars("kl_reverse").to_netcdf(p, engine="h5netcdf")
    with pytest.raises(ResultsError, match="metrics missing: kl_reverse"):
        results.load(p)
    bad = ds.copy()
    bad.attrs = {k: v for k, v in ds.attrs.items() if k not in ("seed", "domain")}
    bad.to_netcdf(p, engine="h5netcdf")
    with pytest.raises(ResultsError, match="attrs missing: domain, seed"):
        results.load(p)
    ds.drop_vars("token_id").to_netcdf(p, engine="h5netcdf")
    with pytest.raises(ResultsError, match="coord 'token_id' missing"):
        results.load(p)


def test_merge_two_shards(tmp_path):
    a = make(n=4, docs=["a", "a", "b", "b"], offset=0.0)
    b = make(n=2, docs=["c", "c"], positions=[70, 80], offset=5.0, created="later")
    results.save(a, tmp_path / "shard-00000.nc")
    results.save(b, tmp_path / "shard-00001.nc")
    parts = [results.load(tmp_path / f"shard-0000{i}.nc") for i in range(2)]
    merged = results.merge(parts)
    assert dict(merged.sizes) == {"target": 6, "window": 3}
    assert merged["doc"].values.tolist() == ["a", "a", "b", "b", "c", "c"]
    assert merged["position"].values.tolist() == [64, 65, 66, 67, 70, 80]
    np.testing.assert_array_equal(merged["tv"].values[:4], a["tv"].values)
    np.testing.assert_array_equal(merged["tv"].values[4:], b["tv"].values)
    assert merged["tv"].values[4, 0] == np.float32(5.0)
    assert merged.attrs["created"] == a.attrs["created"]  # attrs of the first shard
    results.save(merged, tmp_path / "merged.nc")
    xr.testing.assert_equal(results.load(tmp_path / "merged.nc"), merged)


def test_merge_errors():
    with pytest.raises(ResultsError, match="nothing to merge"):
        results.merge([])
    a = make()
    b = results.make_results(metrics_for(2), "window", [1, 4, 32], ["c", "c"], [1, 2], [3, 4], attrs())
    with pytest.raises(ResultsError, match="shards have different windows/budgets"):
        results.merge([a, b])


def test_utc_now_is_iso8601_utc():
    import datetime as dt

    s = results.utc_now()
    t = dt.datetime.fromisoformat(s)
    assert t.utcoffset() == dt.timedelta(0)
    assert s.endswith("+00:00") and "." not in s
