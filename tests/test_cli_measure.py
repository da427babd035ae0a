"""`truncsens measure` and `truncsens show` through the Typer app: happy path and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from truncsens import results
from truncsens.cli.main import app
from truncsens.divergences import METRICS

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def measure_args(model, corpus, out, *extra):
    return ["measure", "--model", model, "--corpus", corpus, "--out", out, "--no-progress", *extra]


def assert_user_error(result, *fragments: str) -> str:
    """Exit code 2, one `error: ...` line on stderr, no traceback; returns the stderr text."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    err = result.stderr
    assert "Traceback" not in result.output
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def measured(tiny_llama_dir, corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("measure") / "run.nc"
    result = invoke(*measure_args(tiny_llama_dir, corpus_dir, out, "--reference-context", "64", "--windows", "1,4,16"))
    return result, out


def test_measure_happy_path(measured, corpus_dir):
    result, out = measured
    assert result.exit_code == 0, (result.output, result.exception)
    assert out.is_file()
    assert not Path(str(out) + ".shards").exists()  # shards merged and removed
    first = result.stdout.splitlines()[0]
    # 6 documents, 8 targets each (every fixture document is longer than 64 + 8 tokens)
    assert first == f"wrote {out}: 48 targets from 6 documents (0 of 6 too short for N=64), windows 1, 4, 16"
    assert "\ntv\n" in "\n" + result.stdout and "\nkl\n" in result.stdout
    ds = results.load(out)
    for m in METRICS:
        assert ds[m].shape == (48, 3)
    assert ds["window"].values.tolist() == [1, 4, 16]
    assert sorted(set(ds["doc"].values.tolist())) == [f"doc{i}.txt" for i in range(6)]
    assert int(ds["position"].min()) >= 64
    tv = ds["tv"].values
    assert np.all((tv >= 0) & (tv <= 1))
    assert tv.mean() > 0  # a random model still depends on its context
    assert tv[:, 0].mean() >= tv[:, 2].mean()  # one token of context is further from the reference than 16


def test_show_json(measured, tiny_llama_dir, corpus_dir):
    _, out = measured
    result = invoke("show", out, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["file"] == str(out)
    assert data["sweep"] == "window"
    a = data["attrs"]
    assert a["semantics"] == "reencode"
    assert a["positions"] == "original"
    assert a["reference_context"] == 64
    assert a["corpus"] == corpus_dir
    assert a["domain"] == Path(corpus_dir).name
    assert a["model"] == tiny_llama_dir
    assert a["n_sink"] == 0 and a["seed"] == 0 and a["dtype"] == "float32" and a["device"] == "cpu"
    assert a["log_base"] == "e"
    assert a["created"].endswith("+00:00")
    assert len(a["corpus_sha256"]) == 64
    rows = data["rows"]
    assert len(rows) == len(METRICS) * 3
    assert [(r["metric"], r["window"]) for r in rows[:3]] == [("tv", 1), ("tv", 4), ("tv", 16)]
    assert all(r["n"] == 48 for r in rows)
    ds = results.load(out)
    assert rows[0]["mean"] == pytest.approx(float(ds["tv"].values[:, 0].astype(np.float64).mean()))


def test_show_table_and_metric_filter(measured):
    _, out = measured
    result = invoke("show", out, "-m", "kl")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{out}: model ")
    assert "semantics reencode, positions original, sinks 0, reference context 64, 48 targets" in lines[0]
    assert lines[1] == "kl"
    assert len(lines) == 2 + 1 + 3  # header line, title, column names, 3 windows


def test_show_of_a_dataset_in_memory_prints_what_the_command_prints(measured):
    import truncsens

    _, out = measured
    printed = invoke("show", out, "-m", "kl").stdout.splitlines()
    summary = truncsens.show(truncsens.load(out), metrics="kl")  # a Dataset, as truncsens.measure returns
    lines = summary.table().splitlines()
    assert lines[0].startswith("<in memory>: model ")
    assert lines[0].split(": ", 1)[1] == printed[0].split(": ", 1)[1]
    assert lines[1:] == printed[1:]


def test_show_bad_files(tmp_path, measured):
    _, out = measured
    assert_user_error(invoke("show", tmp_path / "none.nc"), "results file not found")
    txt = tmp_path / "x.nc"
    txt.write_text("hello")
    assert_user_error(invoke("show", txt), "is not a NetCDF results file")
    assert_user_error(invoke("show", out, "-m", "bogus"), "unknown metric(s) bogus")


def test_window_not_below_reference_context(tiny_llama_dir, corpus_dir, tmp_path):
    r = invoke(*measure_args(tiny_llama_dir, corpus_dir, tmp_path / "o.nc", "--reference-context", "64",
                             "--windows", "4,64"))
    assert_user_error(r, "window 64 >= reference context 64")
    assert not (tmp_path / "o.nc").exists()


def test_reference_context_beyond_model_limit(tiny_llama_dir, corpus_dir, tmp_path):
    r = invoke(*measure_args(tiny_llama_dir, corpus_dir, tmp_path / "o.nc", "--reference-context", "512"))
    assert_user_error(r, "reference context 512 is beyond the model's position limit of 256 tokens",
                      "reference_context=256 or less (--reference-context 256)")


def test_no_document_long_enough(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    corpus = tmp_path / "short"
    corpus.mkdir()
    texts = ["def f(x): return x", "import os", "The quick brown fox."]
    for i, t in enumerate(texts):
        (corpus / f"{i}.txt").write_text(t)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    longest = max(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
    assert longest < 64
    r = invoke(*measure_args(tiny_llama_dir, corpus, tmp_path / "o.nc", "--reference-context", "64"))
    assert_user_error(r, f"no document is long enough: checked 3 documents, the longest has {longest} tokens, "
                         "and a target needs 65")


def test_missing_model_path(corpus_dir, tmp_path):
    missing = tmp_path / "no_model"
    r = invoke(*measure_args(str(missing), corpus_dir, tmp_path / "o.nc"))
    assert_user_error(r, f"model path {missing} does not exist")


def test_model_folder_without_config(corpus_dir, tmp_path):
    folder = tmp_path / "not_a_ckpt"
    folder.mkdir()
    r = invoke(*measure_args(str(folder), corpus_dir, tmp_path / "o.nc"))
    assert_user_error(r, "holds no config.json: it is not a Hugging Face checkpoint folder")


def test_empty_corpus_folder(tiny_llama_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = invoke(*measure_args(tiny_llama_dir, empty, tmp_path / "o.nc", "--reference-context", "64"))
    assert_user_error(r, f"corpus folder {empty} has no non-empty UTF-8 text files")


def test_jsonl_without_text_field(tiny_llama_dir, tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text('{"content": "alpha beta"}\n')
    r = invoke(*measure_args(tiny_llama_dir, data, tmp_path / "o.nc", "--reference-context", "64"))
    assert_user_error(r, "c.jsonl:1 has no field 'text'; pass --text-field NAME")


def test_existing_shards_without_resume(tiny_llama_dir, corpus_dir, tmp_path):
    out = tmp_path / "o.nc"
    shards = Path(str(out) + ".shards")
    shards.mkdir()
    (shards / "shard-00000.nc").write_bytes(b"partial")
    r = invoke(*measure_args(tiny_llama_dir, corpus_dir, out, "--reference-context", "64", "--windows", "1,4"))
    line = assert_user_error(r, f"an earlier run left shards in {shards}: pass --resume to continue it")
    assert line.startswith("error: an earlier run left shards")
    # no "resume" note: the shards are not this run's (this one is 7 bytes of nothing), and the error says what to do
    assert "note:" not in r.stderr
    assert (shards / "shard-00000.nc").read_bytes() == b"partial"  # nothing deleted


def test_bogus_positions(tiny_llama_dir, corpus_dir, tmp_path):
    r = invoke(*measure_args(tiny_llama_dir, corpus_dir, tmp_path / "o.nc", "--reference-context", "64",
                             "--positions", "bogus"))
    assert_user_error(r, "positions (--positions) must be one of ('original', 'reindexed'), got 'bogus'")


def test_bad_windows_text(tiny_llama_dir, corpus_dir, tmp_path):
    r = invoke(*measure_args(tiny_llama_dir, corpus_dir, tmp_path / "o.nc", "--windows", "1,four"))
    assert_user_error(r, "--windows must be comma-separated whole numbers, got '1,four'")


def test_bad_dtype_and_device(tiny_llama_dir, corpus_dir, tmp_path):
    r = invoke(*measure_args(tiny_llama_dir, corpus_dir, tmp_path / "o.nc", "--dtype", "fp8"))
    assert_user_error(r, "unknown dtype 'fp8'")
    r = invoke(*measure_args(tiny_llama_dir, corpus_dir, tmp_path / "o.nc", "--device", "tpu9"))
    assert_user_error(r, "unknown device 'tpu9'")


def test_user_errors_messages():
    """OSError-style exceptions print as a sentence, not as their errno."""
    import typer

    from truncsens.cli.errors import user_errors

    def run(exc):
        app1 = typer.Typer()

        @app1.command()
        def go() -> None:
            with user_errors():
                raise exc

        return runner.invoke(app1, [])

    r = run(FileNotFoundError(2, "No such file or directory", "/x/y.txt"))
    assert r.exit_code == 2
    assert r.stderr == "error: [Errno 2] No such file or directory: '/x/y.txt'\n"
    assert run(KeyError("path")).stderr == "error: path\n"
    assert run(ValueError("plain message")).stderr == "error: plain message\n"
    assert run(RuntimeError()).stderr == "error: RuntimeError\n"
    r = run(ZeroDivisionError("not a user error"))
    assert r.exit_code == 1 and isinstance(r.exception, ZeroDivisionError)


def test_bad_manifest_through_cli(tiny_llama_dir, tmp_path):
    (tmp_path / "m.yaml").write_text("name: x\ndomain: nl\nsource: local\npath: gone.txt\n")
    r = invoke(*measure_args(tiny_llama_dir, tmp_path / "m.yaml", tmp_path / "o.nc", "--reference-context", "64"))
    assert_user_error(r, "local corpus path", "gone.txt does not exist")


def test_show_json_is_valid_json_with_one_target(tmp_path):
    """The standard error of one target is undefined: --json must print null, not bare NaN."""
    from truncsens.results.constructed import curve_results

    ds = curve_results({"tv": lambda w: 0.1 * w**-0.5}, [1, 2, 4], n_docs=1).isel(target=[0])
    results.save(ds, tmp_path / "one.nc")
    r = invoke("show", tmp_path / "one.nc", "--json", "-m", "tv")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert [row["se"] for row in data["rows"]] == [None, None, None]
    assert [row["mean"] for row in data["rows"]] == pytest.approx([0.1, 0.1 * 2**-0.5, 0.05], rel=1e-6)
    assert data["attrs"]["reference_context"] == 1024


def test_synthetic_corpus_needs_a_synthetic_model(tiny_llama_dir, tmp_path):
    r = invoke(*measure_args(tiny_llama_dir, "synthetic", tmp_path / "o.nc", "--reference-context", "64"))
    assert_user_error(r, "corpus='synthetic' (--corpus synthetic)", "needs model='synthetic:ALPHA' (--model synthetic:ALPHA)")
    assert not (tmp_path / "o.nc").exists()


def test_out_is_a_folder_fails_before_any_work(tiny_llama_dir, corpus_dir, tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    r = invoke(*measure_args(tiny_llama_dir, corpus_dir, folder, "--reference-context", "64", "--windows", "1,4"))
    assert_user_error(r, f"out (--out) {folder} is a folder")
    assert not Path(str(folder) + ".shards").exists()  # nothing computed, nothing left behind


def test_out_below_a_file_fails_before_any_work(tiny_llama_dir, corpus_dir, tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("mine")
    out = blocker / "sub" / "o.nc"
    r = invoke(*measure_args(tiny_llama_dir, corpus_dir, out, "--reference-context", "64", "--windows", "1,4"))
    assert_user_error(r, "--out", f"cannot write {out}: {blocker} is a file, not a folder")
    assert blocker.read_text() == "mine"


def test_check_creatable(tmp_path):
    import os

    from truncsens.results.paths import check_creatable

    check_creatable(tmp_path / "new" / "deeper" / "x.json")  # missing folders are fine: they are created
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder"):
        check_creatable(tmp_path / "f" / "x.json")
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # root may write anywhere: then there is nothing to refuse
            with pytest.raises(PermissionError, match="not writable"):
                check_creatable(locked / "x.json")
    finally:
        locked.chmod(0o700)


def test_os_errors_are_user_errors():
    import typer

    from truncsens.cli.errors import user_errors

    app1 = typer.Typer()

    @app1.command()
    def go() -> None:
        with user_errors():
            raise PermissionError(13, "Permission denied", "/root/x.nc")

    r = runner.invoke(app1, [])
    assert r.exit_code == 2 and r.stderr == "error: [Errno 13] Permission denied: '/root/x.nc'\n"


def test_bad_split_is_refused_even_for_synthetic_sources(tmp_path):
    r = invoke("measure", "--model", "synthetic:0.5:64", "--split", "validation", "--out", tmp_path / "o.nc", "--no-progress")
    assert_user_error(r, "split (--split) must be one of auto, train, heldout, all; got 'validation'")
