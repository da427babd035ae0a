"""Results schema: make_results / validate / save / load / merge and ResultsError."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from truncsens import results
from truncsens.results import codec
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
    out = {m: (base + i) / 10 for i, m in enumerate(METRICS)}  # inside every metric's range (js <= ln 2)
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
    assert ds["tv"].values[1, 2] == np.float32(0.005)
    assert ds["kl"].values[0, 0] == np.float32(0.1)  # METRICS[1] gets offset 1 (then / 10)
    assert ds["top1_agree"].values.tolist() == [[0, 1, 0], [1, 0, 1], [0, 1, 0], [1, 0, 1]]
    assert ds.attrs["log_base"] == "e"
    assert results.sweep_dim(ds) == "window"


def test_make_results_keeps_attrs_as_given():
    ds = make(model_revision=None, n_sink=True, extra_path=__import__("pathlib").Path("/x/y"))
    assert ds.attrs["model_revision"] is None
    assert ds.attrs["n_sink"] is True
    assert ds.attrs["extra_path"] == __import__("pathlib").Path("/x/y")
    assert ds["doc"].dtype == object  # variable-length strings, not a fixed width


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
    ds = results.make_results(m, "budget", [8, 32], ["a", "b", "c"], [69, 70, 71], [1, 2, 3], attrs(),
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
    ds.drop_vars(list(METRICS)).to_netcdf(p, engine="h5netcdf")  # a file needs at least one metric (test_metrics.py: a subset loads)
    with pytest.raises(ResultsError, match="no metric"):
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
    b = make(n=2, docs=["c", "c"], positions=[70, 80], offset=0.25, created="later")
    results.save(a, tmp_path / "shard-00000.nc")
    results.save(b, tmp_path / "shard-00001.nc")
    parts = [results.load(tmp_path / f"shard-0000{i}.nc") for i in range(2)]
    merged = results.merge(parts)
    assert dict(merged.sizes) == {"target": 6, "window": 3}
    assert merged["doc"].values.tolist() == ["a", "a", "b", "b", "c", "c"]
    assert merged["position"].values.tolist() == [64, 65, 66, 67, 70, 80]
    np.testing.assert_array_equal(merged["tv"].values[:4], a["tv"].values)
    np.testing.assert_array_equal(merged["tv"].values[4:], b["tv"].values)
    assert merged["tv"].values[4, 0] == np.float32(0.025)
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


# ---------------------------------------------------------------- strings through shards, merge, save, load


def _through_shards(tmp_path, shards: list[list[str]]) -> xr.Dataset:
    """Save each list of ids as a shard, load and merge them, save and load the merged file."""
    for i, ids in enumerate(shards):
        results.save(make(n=len(ids), docs=ids), tmp_path / f"shard-{i}.nc")
    merged = results.merge([results.load(tmp_path / f"shard-{i}.nc") for i in range(len(shards))])
    assert merged["doc"].values.tolist() == [d for ids in shards for d in ids]
    results.save(merged, tmp_path / "merged.nc")
    return results.load(tmp_path / "merged.nc")


def test_merge_keeps_ids_longer_than_the_first_shards(tmp_path):
    """The README's reference-code.nc: short ids in shard 0 cut later ids to one character."""
    long_ids = ["code/encodings/mac_latin2.py", "code/encodings/mac_latin2.py", "code/idlelib/hyperparser.py",
                "code/idlelib/hyperparser.py"]
    back = _through_shards(tmp_path, [["a", "a"], long_ids])
    assert back["doc"].values.tolist() == ["a", "a"] + long_ids
    assert back["doc"].dtype == object


def test_merge_keeps_ids_that_share_a_prefix_apart(tmp_path):
    # cut to 12 characters both ids would read "code/a_long_" and the two documents would collapse into one
    back = _through_shards(tmp_path, [["code/a_long_", "code/a_long_"], ["code/a_long_name_1.py", "code/a_long_name_2.py"],
                                      ["z"]])
    ids = back["doc"].values.tolist()
    assert ids == ["code/a_long_", "code/a_long_", "code/a_long_name_1.py", "code/a_long_name_2.py", "z"]
    assert len(set(ids)) == 4


ODD_IDS = [
    "",  # empty document id
    "a\x00b",  # embedded NUL (HDF5 strings end at NUL: ValueError before)
    os.fsdecode(b"caf\xe9.txt") if os.name != "nt" else "caf\udce9.txt",  # a Latin-1 file name: 'caf\\udce9.txt'
    "\ud800",  # a lone high surrogate
    "back\\slash",  # the escape character itself
    "\\x00 and \\udce9 written out",  # text that looks like an escape
    "日本語/ファイル.py",
    "\U0001f600 emoji",
]


def test_every_text_round_trips_through_shards(tmp_path):
    assert ODD_IDS[2] == "caf\udce9.txt"
    back = _through_shards(tmp_path, [ODD_IDS[:3], ODD_IDS[3:]])
    assert back["doc"].values.tolist() == ODD_IDS
    assert os.fsencode(back["doc"].values[2]) == b"caf\xe9.txt"  # the original file name bytes


def test_plain_ids_are_stored_verbatim_and_odd_ones_escaped(tmp_path):
    plain = make(n=2, docs=["é/x.py", "back\\slash"])
    results.save(plain, tmp_path / "plain.nc")
    with xr.open_dataset(tmp_path / "plain.nc", engine="h5netcdf") as raw:
        assert raw["doc"].values.tolist() == ["é/x.py", "back\\slash"]  # no escape needed: stored as is
        assert "truncsens_escape" not in raw["doc"].attrs
    odd = make(n=3, docs=["a\x00b", "caf\udce9", "back\\slash"])
    results.save(odd, tmp_path / "odd.nc")
    with xr.open_dataset(tmp_path / "odd.nc", engine="h5netcdf") as raw:
        assert raw["doc"].attrs["truncsens_escape"] == "backslash-1"
        assert raw["doc"].values.tolist() == ["a\\x00b", "caf\\udce9", "back\\\\slash"]
    assert results.load(tmp_path / "odd.nc")["doc"].values.tolist() == ["a\x00b", "caf\udce9", "back\\slash"]
    assert "truncsens_escape" not in results.load(tmp_path / "odd.nc")["doc"].attrs


def test_policy_names_and_variable_attrs_round_trip(tmp_path):
    m = metrics_for(2, W=2, policies=2)
    ds = results.make_results(m, "budget", [8, 32], ["a", "b"], [69, 70], [1, 2], attrs(),
                              policies=["sink_recent", "p\x00\udcff"])
    ds["tv"].attrs["units"] = "probability"
    ds["tv"].attrs["params"] = {"k": [1, None]}
    back = results.load(results.save(ds, tmp_path / "p.nc"))
    assert back["policy"].values.tolist() == ["sink_recent", "p\x00\udcff"]
    assert back["tv"].attrs == {"units": "probability", "params": {"k": [1, None]}}
    xr.testing.assert_identical(back, ds)


@pytest.mark.parametrize("text", ["", "\\", "\\\\x00", "\x00\x00", "\udc80\udcff", "\ud83d\ude00", "a\\u00e9b"])
def test_escape_is_reversible(text):
    e = codec.escape(text)
    assert codec.storable(e)
    assert codec.unescape(e) == text


def test_escape_exact_values_and_random_strings():
    assert codec.escape("a\\b\x00c\udce9") == "a\\\\b\\x00c\\udce9"
    assert codec.unescape("a\\\\b\\x00c\\udce9") == "a\\b\x00c\udce9"
    with pytest.raises(ValueError, match="lone backslash"):
        codec.unescape("a\\qb")
    rng = np.random.default_rng(0)
    alphabet = ["\x00", "\\", "x", "0", "u", "d", "\ud800", "\udfff", "é", "\U0001f600"]
    for _ in range(300):
        s = "".join(rng.choice(alphabet, size=rng.integers(0, 12)))
        assert codec.unescape(codec.escape(s)) == s


# ---------------------------------------------------------------- attrs


STRUCTURED = {
    "unknown": None,
    "flag": True,
    "off": False,
    "np_flag": np.bool_(True),
    "params": {"budget": [8, 16], "nested": {"a": None, "b": 1.5}, "$type": "not a tag"},
    "int_keys": {1: "one", (2, 3): "pair"},
    "list": [1, "two", None, [3.0]],
    "tuple": (1, "x"),
    "empty_list": [],
    "when": dt.datetime(2025, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone.utc),
    "naive": dt.datetime(2024, 2, 29, 23, 59),
    "day": dt.date(2020, 1, 1),
    "at": dt.time(12, 30),
    "took": dt.timedelta(days=1, seconds=2, microseconds=3),
    "where": Path("/data/corpus"),
    "huge": 2**70,
    "nul": "x\x00y",
    "latin1_name": "caf\udce9.txt",
}


def test_structured_attrs_come_back_as_they_went_in(tmp_path):
    ds = make(**STRUCTURED)
    back = results.load(results.save(ds, tmp_path / "a.nc"))
    assert back.attrs == ds.attrs
    for k, v in STRUCTURED.items():
        assert back.attrs[k] == v and type(back.attrs[k]) is type(v), k  # np.bool_ stays np.bool_
    assert back.attrs["flag"] is True and back.attrs["unknown"] is None
    assert back.attrs["when"].tzinfo == dt.timezone.utc


def test_numpy_bools_come_back_as_numpy_bools(tmp_path):
    ds = make(np_flag=np.bool_(False), np_mask=np.array([True, False, True]), mixed=[np.bool_(True), True])
    back = results.load(results.save(ds, tmp_path / "b.nc"))
    assert type(back.attrs["np_flag"]) is np.bool_ and not back.attrs["np_flag"]
    mask = back.attrs["np_mask"]
    assert isinstance(mask, np.ndarray) and mask.dtype == np.bool_ and mask.tolist() == [True, False, True]
    assert [type(v) for v in back.attrs["mixed"]] == [np.bool_, bool]


def test_attrs_set_after_creation_round_trip(tmp_path):
    ds = make()
    ds.attrs["started"] = dt.datetime(2025, 6, 1, 8, 0, tzinfo=dt.timezone.utc)
    ds.attrs["resumed"] = False
    ds.attrs["skipped"] = {"hidden": 3, "not_utf8": 1}
    ds.attrs["note"] = None
    back = results.load(results.save(ds, tmp_path / "later.nc"))
    assert back.attrs == ds.attrs
    assert back.attrs["skipped"] == {"hidden": 3, "not_utf8": 1} and back.attrs["resumed"] is False


def test_plain_attrs_stay_plain_netcdf(tmp_path):
    ds = make(flag=True, score=0.25, params={"a": 1})
    results.save(ds, tmp_path / "p.nc")
    with xr.open_dataset(tmp_path / "p.nc", engine="h5netcdf") as raw:
        assert raw.attrs["model"] == "tiny" and raw.attrs["n_sink"] == 0 and raw.attrs["score"] == 0.25
        assert raw.attrs["model_revision"] == "" and raw.attrs["log_base"] == "e"
        assert raw.attrs["flag"] == "true" and raw.attrs["params"] == '{"a": 1}'
        assert raw.attrs["truncsens_json_attrs"] == '["attrs_fingerprint", "flag", "params"]'  # the fingerprint: a dict
    assert "truncsens_json_attrs" not in results.load(tmp_path / "p.nc").attrs


def test_unstorable_attrs_are_refused_by_name(tmp_path):
    with pytest.raises(ResultsError, match="attr 'weird' holds a object"):
        make(weird=object())
    with pytest.raises(ResultsError, match="attr 'deep' holds a set"):
        make(deep={"a": [{1, 2}]})
    with pytest.raises(ResultsError, match="'truncsens_json_attrs' is reserved"):
        make(truncsens_json_attrs="[]")
    ds = make()
    ds.attrs["later"] = object()
    with pytest.raises(ResultsError, match="attr 'later' holds a object"):
        results.save(ds, tmp_path / "x.nc")
    assert not (tmp_path / "x.nc").exists() and not (tmp_path / "x.nc.tmp").exists()


# ---------------------------------------------------------------- one validator: what save writes, load reads


def _written_raw(ds: xr.Dataset, path: Path) -> Path:
    """``ds`` written with the file encoding but no check (as an older truncsens or a hand edit could)."""
    from truncsens.results import files

    files._encode(ds).to_netcdf(path, engine="h5netcdf")
    return path


def _with_duplicates(ds: xr.Dataset) -> xr.Dataset:
    """The reported file: target 0 appended three more times (4 targets become 7)."""
    return xr.concat([ds, ds.isel(target=[0, 0, 0])], "target")


def _late_datetime(ds):
    ds.attrs["created"] = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
    return ds


def _js_above_ln2(ds):
    ds["js"].values[1, 2] = 0.7  # ln 2 = 0.6931...
    return ds


def _nan_kl(ds):
    ds["kl"].values[2, 0] = np.nan
    return ds


def _short_reference(ds):
    ds.attrs["reference_context"] = 8  # window 16 > N
    return ds


BAD_FILES = {
    "created datetime": (_late_datetime, "attr 'created': rule attrs: it must be ISO 8601 text"),
    "js above ln 2": (_js_above_ln2, "variable 'js': rule range: values must lie in [0, 0.693147]"),
    "NaN kl": (_nan_kl, "variable 'kl': rule range: NaN"),
    "window above N": (_short_reference, "coord 'window': rule coords: windows must lie in [1, reference_context = 8]"),
    "duplicate rows": (_with_duplicates, "rule targets"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_save_refuses_what_load_refuses_with_the_same_message(tmp_path, case):
    """save accepted a datetime ``created`` and a js above ln 2, and load then refused the file it had
    just written: both now run one validator, and save's message is load's plus ``(nothing written)``."""
    edit, fragment = BAD_FILES[case]
    bad = edit(make().copy(deep=True))
    path = _written_raw(bad, tmp_path / "bad.nc")
    with pytest.raises(ResultsError) as on_load:
        results.load(path)
    load_message = str(on_load.value)
    assert load_message.startswith(f"{path}: ") and fragment in load_message
    path.unlink()
    with pytest.raises(ResultsError) as on_save:
        results.save(bad, path)
    assert str(on_save.value) == f"{load_message} (nothing written)"
    assert not path.exists() and not list(tmp_path.iterdir())


def test_a_datetime_created_is_refused_and_its_iso_text_round_trips(tmp_path):
    """``created`` is ISO 8601 text (required, typed); a datetime in any free attr comes back a datetime."""
    when = dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    with pytest.raises(ResultsError, match=r"attr 'created'.*ISO 8601 text .*\.isoformat\(\)\), got datetime"):
        results.save(make(created=when), tmp_path / "d.nc")
    back = results.load(results.save(make(created=when.isoformat(), started=when), tmp_path / "t.nc"))
    assert back.attrs["created"] == "2025-01-02T03:04:05+00:00"
    assert dt.datetime.fromisoformat(back.attrs["created"]) == when
    assert back.attrs["started"] == when and type(back.attrs["started"]) is dt.datetime
    assert back.attrs["started"].tzinfo == dt.timezone.utc


def test_duplicate_rows_are_refused_on_save_and_load(tmp_path):
    """The reported file: 4 targets + target 0 three more times. Its mean would count doc d0 position 64
    four times; it is refused, naming the pair, its count and its rows."""
    dup = _with_duplicates(make())
    assert dup.sizes["target"] == 7
    want = ("rule targets: a (doc, position) pair may appear only once per layer, policy and draw; 1 (doc, position) "
            "pair appears more than once (4 rows in all): doc 'd0' position 64 (4 times, at target=0,4,5,6)")
    with pytest.raises(ResultsError) as exc:
        results.save(dup, tmp_path / "dup.nc")
    assert str(exc.value) == f"{tmp_path / 'dup.nc'}: {want} (nothing written)"
    assert not (tmp_path / "dup.nc").exists()
    path = _written_raw(dup, tmp_path / "dup.nc")
    with pytest.raises(ResultsError) as exc:
        results.load(path)
    assert str(exc.value) == f"{path}: {want}"


def test_many_duplicate_pairs_are_named_three_and_counted(tmp_path):
    ds = make(n=4, docs=["a", "b", "c", "d"])
    twice = xr.concat([ds, ds, ds.isel(target=[3])], "target")  # every pair twice, d three times
    with pytest.raises(ResultsError) as exc:
        results.validate(twice)
    assert str(exc.value).endswith(
        "4 (doc, position) pairs appear more than once (9 rows in all): doc 'a' position 64 (2 times, at target=0,4); "
        "doc 'b' position 65 (2 times, at target=1,5); doc 'c' position 66 (2 times, at target=2,6); and 1 more")
    # one document at two positions, or two documents at one position, are distinct targets
    results.validate(make(n=3, docs=["a", "a", "b"], positions=[64, 65, 64]))


def test_duplicates_across_policies_and_draws_are_one_rule(tmp_path):
    """Targets are shared by the policy and draw dims: a repeated (doc, position) is refused in a
    [policy, draw, target, budget] file as in a window file."""
    m = {k: np.repeat(v[:, None], 2, axis=1) for k, v in metrics_for(3, W=2, policies=2).items()}  # [P, R, n, K]
    ds = results.make_results(m, "budget", [8, 32], ["a", "b", "a"], [69, 70, 69], [1, 2, 3], attrs(),
                              policies=["suffix", "random"], draws=2)
    assert ds["tv"].dims == ("policy", "draw", "target", "budget")
    with pytest.raises(ResultsError, match=r"doc 'a' position 69 \(2 times, at target=0,2\)"):
        results.save(ds, tmp_path / "pd.nc")


def test_merge_refuses_a_target_in_two_shards(tmp_path):
    a = make(n=4, docs=["a", "a", "b", "b"])  # b at 66, 67
    b = make(n=2, docs=["b", "c"], positions=[66, 70])
    with pytest.raises(ResultsError) as exc:
        results.merge([a, b], ["s0.nc", "s1.nc"])
    assert str(exc.value) == ("refusing to merge: 1 (doc, position) pair appears more than once (2 rows in all): "
                              "doc 'b' position 66 (2 times, in s0.nc, s1.nc); a target belongs to one shard of one run")
    with pytest.raises(ResultsError, match=r"doc 'a' position 64 \(2 times, in shard 1\)"):  # twice in one shard
        results.merge([b, xr.concat([a.isel(target=[0]), a.isel(target=[0])], "target")])


def test_merge_refuses_shards_of_different_runs(tmp_path):
    a = make(n=2, docs=["a", "a"])
    b = make(n=2, docs=["b", "b"], seed=1)
    with pytest.raises(ResultsError, match=r"^refusing to merge shard 1 with shard 0: they are shards of different "
                                           r"runs \(attr 'seed' is 1 there, 0 here\)$"):
        results.merge([a, b])
    with pytest.raises(ResultsError, match=r"attr 'split' is in shard 1 only"):
        results.merge([a, make(n=2, docs=["b", "b"], split="test")])
    fa, fb = a.copy(), make(n=2, docs=["b", "b"])
    fa.attrs["run_fingerprint"], fb.attrs["run_fingerprint"] = "0" * 64, "1" * 64
    with pytest.raises(ResultsError, match=r"different runs \(run_fingerprint '1{64}' there, '0{64}' here\)"):
        results.merge([fa, fb])
    # shards of one run may differ in when, where and by which command they were written
    later = make(n=2, docs=["b", "b"], created="later", command="truncsens measure --resume", device="cuda:0",
                 truncsens_version="0.2.0", n_clamped=3, shard_index=1)
    assert results.merge([a, later]).sizes["target"] == 4
    fb.attrs.update(run_fingerprint="0" * 64, seed=5)  # the same configuration hash: one run, its attrs not compared
    assert results.merge([fa, fb]).attrs["seed"] == 0
    p1 = results.make_results(metrics_for(2, W=2, policies=2), "budget", [8, 32], ["a", "a"], [69, 70], [1, 2], attrs(),
                              policies=["suffix", "random"])
    p2 = results.make_results(metrics_for(2, W=2, policies=2), "budget", [8, 32], ["b", "b"], [69, 70], [1, 2], attrs(),
                              policies=["suffix", "h2o"])
    with pytest.raises(ResultsError, match="refusing to merge shard 1 with shard 0: their policy coords differ"):
        results.merge([p1, p2])
