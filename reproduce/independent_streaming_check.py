#!/usr/bin/env python
"""Independent recomputation of the streaming sink_recent / full-cache next-token NLL and top-1 of a
`truncsens certify-attribution --semantics streaming` results file.

Model computations are plain transformers/torch: one parallel forward pass per (target, budget) with
an explicit per-query 4D additive attention mask (0 keep, -inf drop); kept tokens keep their original
position ids. No truncsens engine / certificates passes / probes / policies / divergences is imported.

Contexts: rebuilt from the corpus text (truncsens.corpora.load_corpus, tokenized here with the model's
tokenizer) for copy targets, and from truncsens.certificates.tasks.kv_document for kv targets; every
rebuilt target token is checked against the file's stored token_id.

Streaming sink_recent at budget k with S sinks (truncsens's convention, checked against its output):
the query at position t attends to keys j <= t with j < S or j > t - (k - S), i.e. k keys in all
*including its own token* (positions t < k see the whole causal prefix). The restriction applies in
every layer at every position, so this one masked pass equals the token-by-token streaming run.

Usage:
  python reproduce/independent_streaming_check.py RESULTS.nc [--targets 6] [--dtype float32|float64] [--attn eager|sdpa]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch
import xarray as xr

LN4 = math.log(4.0)


def weights_dir() -> Path:
    import truncsens.models.reference as ref
    return Path(ref.__file__).parent / "weights"


def pick_targets(kind: np.ndarray, n_check: int) -> list[int]:
    """Up to n_check target indices spread evenly over the copy and the kv targets."""
    kinds = [k for k in ("copy", "kv") if (kind == k).any()]
    avail = {k: int((kind == k).sum()) for k in kinds}
    per = {k: 0 for k in kinds}
    left = min(n_check, len(kind))
    while left > 0:  # round-robin over the kinds that still have targets
        for k in kinds:
            if left > 0 and per[k] < avail[k]:
                per[k] += 1
                left -= 1
    out = []
    for k in kinds:
        idx = np.flatnonzero(kind == k)
        m = per[k]
        out += [int(idx[i]) for i in np.unique(np.linspace(0, len(idx) - 1, m).round().astype(int))]
    return sorted(out)


class Contexts:
    """Token contexts [N] of the file's targets, rebuilt from the corpus / kv generator."""

    def __init__(self, ds, tok):
        self.ds, self.tok = ds, tok
        a = ds.attrs
        self.N = int(a["reference_context"])
        self._docs = None

    def attr(self, *names, default=None):
        for n in names:
            if n in self.ds.attrs:
                return self.ds.attrs[n]
        return default

    def corpus_docs(self):
        if self._docs is None:
            from truncsens.corpora import load_corpus
            domain = self.attr("domain", default="code")
            split = self.attr("split", default="auto")
            text_field = self.attr("text_field", default="text")
            want = self.attr("corpus_sha256")
            c, tried = None, []
            for spec in (None, self.attr("corpus")):  # the domain's default, then the recorded corpus name
                try:
                    cand = load_corpus(spec, domain, split, text_field)
                except Exception as e:  # noqa: BLE001 - try the next spelling
                    tried.append(f"{spec!r}: {e}")
                    continue
                tried.append(f"{spec!r}: sha {cand.sha256[:12]}")
                if want is None or cand.sha256 == want:
                    c = cand
                    break
            if c is None:
                raise SystemExit(f"cannot reload the corpus with sha256 {want} ({'; '.join(tried)}); "
                                 "pass the corpus explicitly")
            print(f"corpus reloaded: {c.name} ({len(c.documents)} documents of split {split}), "
                  f"sha256 matches the file: {want is None or c.sha256 == want}")
            self._docs = {d.id: d.text for d in c.documents}
            # BOS rule: the tokenizer's default special token in front, if it adds one
            plain = self.tok("a", add_special_tokens=False)["input_ids"]
            full = self.tok("a", add_special_tokens=True)["input_ids"]
            bos = getattr(self.tok, "bos_token_id", None)
            self._bos = bos if (bos is not None and len(full) > len(plain) and full[0] == bos) else None
        return self._docs

    def copy_context(self, doc: str, t: int):
        text = self.corpus_docs()[doc]
        ids = self.tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if self._bos is not None:
            ids = [self._bos, *ids]
        return ids[t - self.N : t], ids[t]

    def kv_context(self, doc: str):
        from truncsens.certificates.tasks import default_min_distance, kv_document
        from truncsens.targets import doc_seed
        _, seed, i = doc.rsplit("-", 2)
        D = int(self.attr("min_distance", default=default_min_distance(self.N)))
        enc = lambda s: self.tok(s, add_special_tokens=False)["input_ids"]
        ids, _ = kv_document(enc, self.N, D, doc_seed(int(seed), f"kv:{int(i)}"))
        return ids[: self.N], ids[self.N]


def sink_recent_mask(N: int, k: int, S: int) -> torch.Tensor:
    """[N, N] bool: query t keeps key j iff j <= t and (j < S or j > t - (k - S))."""
    t = torch.arange(N).view(-1, 1)
    j = torch.arange(N).view(1, -1)
    return (j <= t) & ((j < S) | (j > t - (k - S)))


def causal_mask(N: int) -> torch.Tensor:
    t = torch.arange(N).view(-1, 1)
    j = torch.arange(N).view(1, -1)
    return j <= t


@torch.no_grad()
def last_logprobs(model, ids: list[int], keep: torch.Tensor, dtype) -> torch.Tensor:
    """log-softmax (float64) of the next-token logits after the last token, with the explicit mask."""
    N = len(ids)
    x = torch.tensor(ids, dtype=torch.long).view(1, N)
    pos = torch.arange(N).view(1, N)
    add = torch.zeros(N, N, dtype=dtype).masked_fill(~keep, float("-inf")).view(1, 1, N, N)
    out = model(input_ids=x, position_ids=pos, attention_mask=add, use_cache=False)
    return torch.log_softmax(out.logits[0, -1].to(torch.float64), -1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--targets", type=int, default=6, help="targets to check, spread over copy and kv")
    ap.add_argument("--indices", default=None, help="comma-separated target indices (overrides --targets)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    ap.add_argument("--sinks", type=int, default=None, help="sinks S (default: the file's attr, else 4)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model-dir", default=None,
                    help="Hugging Face folder of weights + tokenizer (default: the bundled reference model when the "
                         "file's model attr is 'reference', else that attr)")
    ap.add_argument("--budget-shift", type=int, default=0,
                    help="diagnostic only: attend to k + SHIFT keys (e.g. -1: current token not counted in k)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    ds = xr.open_dataset(args.results)
    a = ds.attrs
    N = int(a["reference_context"])
    failure_nll = float(a.get("failure_nll", LN4))
    S = args.sinks if args.sinks is not None else int(a.get("n_sink", a.get("sinks", 4)))
    policies = [str(p) for p in ds["policy"].values]
    if "sink_recent" not in policies:
        print(f"warning: no sink_recent policy in the file (policies: {policies}); only the full cache is checked")
    budgets = [int(b) for b in ds["budget"].values]
    if "kept_tokens" in ds and "sink_recent" in policies:  # the budget in tokens as the run kept it
        kt = ds["kept_tokens"].sel(policy="sink_recent").values  # [n, K]
    else:
        kt = None
    kind = np.asarray(ds["task_kind"].values, dtype=str)
    doc = np.asarray(ds["doc"].values, dtype=str)
    position = ds["position"].values.astype(int)
    token_id = ds["token_id"].values.astype(int)
    idx = [int(i) for i in args.indices.split(",")] if args.indices else pick_targets(kind, args.targets)

    print(f"file: {args.results}")
    print(f"N = {N}, budgets = {budgets}, sinks S = {S}, policies = {policies}, failure_nll = {failure_nll:.6f}, "
          f"semantics/process: {a.get('certified_process', a.get('semantics', '?'))!s:.60}")
    print(f"model: {a.get('model', '?')}, dtype (file) {a.get('dtype', '?')}; recompute dtype {args.dtype}, attn {args.attn}")
    print(f"targets checked: {idx} (of {len(kind)}; kinds {[str(kind[i]) for i in idx]})")

    from transformers import AutoModelForCausalLM, AutoTokenizer
    wdir = args.model_dir or (weights_dir() if str(a.get("model", "reference")) == "reference" else str(a["model"]))
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    tok = AutoTokenizer.from_pretrained(wdir)
    model = AutoModelForCausalLM.from_pretrained(wdir, dtype=dtype, attn_implementation=args.attn).eval()
    ctx = Contexts(ds, tok)

    # sanity: an explicit causal 4D mask equals the model's own causal masking
    probe = list(range(5, 69))
    lp_own = torch.log_softmax(model(input_ids=torch.tensor([probe])).logits[0, -1].double(), -1)
    lp_mask = last_logprobs(model, probe, causal_mask(len(probe)), dtype)
    print(f"sanity: explicit causal mask vs built-in causal: max|dlogp| = {(lp_own - lp_mask).abs().max().item():.2e}")

    nll_ref_f = ds["nll_ref"].values
    nll_kept_f = ds["nll_kept"].values
    arg_ref_f = ds["argmax_ref"].values.astype(int) if "argmax_ref" in ds else None
    arg_kept_f = ds["argmax_kept"].values.astype(int) if "argmax_kept" in ds else None
    if nll_ref_f.ndim == 3:  # (policy, target, budget): the same reference under every policy and budget
        spread = float(np.nanmax(np.abs(nll_ref_f - nll_ref_f[:1, :, :1])))
        print(f"nll_ref stored per (policy, target, budget): max spread over policy/budget {spread:.2e}")
        nll_ref_f = nll_ref_f[0, :, 0]
    p_sr = policies.index("sink_recent") if "sink_recent" in policies else None

    rows = []
    max_d_ref, max_d_sr = 0.0, 0.0
    flag_mismatch, top1_mismatch, n_flags = 0, 0, 0
    for i in idx:
        if kind[i] == "kv":
            ids, tgt = ctx.kv_context(doc[i])
        else:
            ids, tgt = ctx.copy_context(doc[i], int(position[i]))
        if tgt != token_id[i] or len(ids) != N:
            print(f"ERROR target {i} ({doc[i]} @ {position[i]}): rebuilt target token {tgt} / len {len(ids)} "
                  f"!= stored {token_id[i]} / N {N}")
            return 2
        def check(keep: torch.Tensor, f_nll: float, f_top, policy: str, budget: str) -> float:
            """Recompute one pass, compare it with the file's values, add a row; returns |dNLL|."""
            nonlocal n_flags, flag_mismatch, top1_mismatch
            lp = last_logprobs(model, ids, keep, dtype)
            nll, top = -lp[tgt].item(), int(lp.argmax())
            fail = (top != tgt) or nll > failure_nll
            f_fail = (f_top != tgt if f_top is not None else False) or f_nll > failure_nll
            n_flags += 1
            flag_mismatch += fail != f_fail
            top1_mismatch += (f_top is not None and f_top != top)
            rows.append((i, kind[i], policy, budget, nll, f_nll, abs(nll - f_nll), top == tgt,
                         (f_top == tgt) if f_top is not None else None, fail, f_fail, top, f_top))
            return abs(nll - f_nll)

        max_d_ref = max(max_d_ref, check(causal_mask(N), float(nll_ref_f[i]),
                                         arg_ref_f[i] if arg_ref_f is not None else None, "full", "-"))
        if p_sr is None:
            continue
        for j, k in enumerate(budgets):
            kk = f"{k}" + (f" (kept {int(kt[i, j])})" if kt is not None else "")
            max_d_sr = max(max_d_sr, check(sink_recent_mask(N, k + args.budget_shift, S), float(nll_kept_f[p_sr, i, j]),
                                           int(arg_kept_f[p_sr, i, j]) if arg_kept_f is not None else None,
                                           "sink_recent", kk))

    hdr = (f"{'tgt':>4} {'kind':>4} {'policy':>11} {'budget':>15} {'nll_mine':>11} {'nll_file':>11} {'|dNLL|':>9} "
           f"{'top1_mine':>9} {'top1_file':>9} {'fail_mine':>9} {'fail_file':>9} {'argmax m/f':>12}")
    print()
    print(hdr)
    print("-" * len(hdr))
    for (i, kd, pol, k, nm, nf, d, tm, tf, fm, ff, am, af) in rows:
        mark = "" if (fm == ff and am == af) else "   <-- MISMATCH"
        print(f"{i:>4} {kd:>4} {pol:>11} {k:>15} {nm:>11.6f} {nf:>11.6f} {d:>9.2e} {str(tm):>9} {str(tf):>9} "
              f"{str(fm):>9} {str(ff):>9} {f'{am}/{af}':>12}{mark}")
    print()
    print(f"max |dNLL| full cache:  {max_d_ref:.3e}")
    print(f"max |dNLL| sink_recent: {max_d_sr:.3e}")
    print(f"top-1 id disagreements: {top1_mismatch} of {n_flags}")
    print(f"failure flags agree:    {n_flags - flag_mismatch} of {n_flags}" + ("" if flag_mismatch == 0 else "  (DISAGREE)"))
    return 0 if flag_mismatch == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
