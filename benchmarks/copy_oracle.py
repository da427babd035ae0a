"""How well can pure copying do on the copy targets of ``certify-attribution``? (against an aim of
70 % full-cache copy accuracy, and why the reference model misses it). Not a speed benchmark.

The copy targets (:func:`truncsens.certificates.tasks.copy_positions`) are positions t of held-out
code whose token occurred before, most recently at distance D = N/4 or more (and not since), with
the same preceding token there. A model that only copies predicts the token that followed an
earlier occurrence of the current suffix. Two copy rules, run on exactly the contexts the model
reads (its last N tokens), predict the target:

- ``suffix-k``: the token after the most recent earlier occurrence of the last k tokens (k = 1, 2, 3);
- ``longest``: the token after the earlier occurrence with the longest matching suffix (up to 64
  tokens; the most recent among equally long ones): what an ideal induction head retrieves.

Next to them, the model's own full-cache top-1 accuracy on the same targets (what
:func:`truncsens.api.reference.task_accuracy` counts, here per target). If the copy rules fall short of the aim, the aim
asks for more than copying: the most recent match of a suffix in code usually continues differently
from the far one the target copies.

Two more rows ask how far copying could lift this model. ``model, source evicted``: its top-1 when
it reads only the last D − 1 tokens of the context (re-encoded, positions from 0), where the target
token does not occur (a copy target's token is nowhere in its last D − 1 tokens), so only what it
knows of code predicts it. ``either``: targets that the model without the source or the ideal
induction head (``longest``) gets right, the accuracy of a model that knew, target by target, which
of the two to trust; and the same with the full-cache model in place of the model without the
source. These are not bounds for every model (a better model of code would know more), but they say
how much of the aim perfect copying adds to what this model already predicts.

Two last rows say how the model misses: how many targets lie in its top 5 (it knows the candidates
but ranks another first), and how many distinct tokens follow an earlier occurrence of the token
before the target in the context (median over targets): the choices a copier keyed on that token
has, of which the target is one.

``--copy-rule span`` reads the targets of that rule instead (the four tokens before the target repeat
those before its source, and nowhere nearer: the copy is unambiguous for a four-token induction head).

Usage (about 30 s on 2 CPU cores at N = 2048)::

    python benchmarks/copy_oracle.py --reference-context 2048 [--copy-rule span] [--model PATH] [--out results/copy-oracle.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

MAX_MATCH = 64  # longest suffix compared, tokens
TOP_K = 5  # the model's top-k row


def suffix_rule(context: Sequence[int], k: int) -> int | None:
    """The token after the most recent earlier occurrence of the last ``k`` tokens of ``context``
    (None: the suffix never occurred before)."""
    n = len(context)
    suffix = list(context[n - k:])
    for s in range(n - 1, k - 1, -1):  # the occurrence ends at s - 1, so context[s] follows it
        if list(context[s - k:s]) == suffix:
            return int(context[s])
    return None


def longest_rule(context: Sequence[int], max_match: int = MAX_MATCH) -> int | None:
    """The token after the earlier occurrence of the longest matching suffix (at most ``max_match``
    tokens; the most recent of equally long ones); None when the last token never occurred before."""
    n, best, pred = len(context), 0, None
    for s in range(n - 1, 0, -1):
        m = 0
        while m < s and m < max_match and context[s - 1 - m] == context[n - 1 - m]:
            m += 1
        if m > best:
            best, pred = m, int(context[s])
    return pred


def continuations(context: Sequence[int]) -> int:
    """How many distinct tokens follow an earlier occurrence of the last token of ``context``: the
    candidates among which a copier keyed on that one token must choose (0: it never occurred before)."""
    last = context[-1]
    return len({context[s + 1] for s in range(len(context) - 1) if context[s] == last})


def target_rank(loaded, contexts, targets, batch: int = 4):
    """[n] int64 rank of each target in ``loaded``'s next-token logits after its row of ``contexts``
    ([n, L] token ids, L tokens read from position 0; ``targets`` [n] token ids): the number of
    tokens with a larger logit, so 0 is a top-1 hit and < k a top-k hit."""
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, contexts.shape[0], batch):
            ids = contexts[i : i + batch].to(loaded.device)  # [b, L]
            logits = loaded.model(input_ids=ids, logits_to_keep=1).logits[:, -1].float().cpu()  # [b, V]
            own = logits.gather(1, targets[i : i + batch, None])  # [b, 1]
            out.append((logits > own).sum(-1))  # [b]
    return torch.cat(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="reference")
    ap.add_argument("--reference-context", type=int, default=2048)
    ap.add_argument("--copy-rule", default="induction", help="the targets' copy rule (certify-attribution's --copy-rule)")
    ap.add_argument("--out", default=None, help="write the counts as JSON here")
    args = ap.parse_args(argv)
    if args.out and Path(args.out).exists():  # checked before minutes of work, not after
        sys.exit(f"error: {args.out} already exists; remove it or choose another --out")

    import numpy as np

    from truncsens.api.reference import attribution_tasks
    from truncsens.certificates.tasks import default_min_distance
    from truncsens.models import load_model

    loaded = load_model(args.model)
    N = args.reference_context
    tasks = attribution_tasks(loaded, N, copy_rule=args.copy_rule)
    copy = np.flatnonzero(np.asarray(tasks.kind) == "copy")
    rules = {f"suffix-{k}": (lambda c, k=k: suffix_rule(c, k)) for k in (1, 2, 3)} | {"longest": longest_rule}
    right = {name: np.zeros(len(copy), dtype=bool) for name in rules}  # [n] per rule
    for j, i in enumerate(copy):
        context, target = tasks.targets.context[i].tolist(), int(tasks.targets.token_id[i])
        for name, rule in rules.items():
            right[name][j] = rule(context) == target
    hits = {name: int(r.sum()) for name, r in right.items()}
    D = default_min_distance(N)
    target = tasks.targets.token_id[copy]  # [n]
    rank = target_rank(loaded, tasks.targets.context[copy], target).numpy()  # [n]
    full = rank == 0  # [n], task_accuracy's copy count per target
    model = {"correct": int(full.sum()), "n": len(copy), "accuracy": float(full.mean()) if len(copy) else float("nan")}
    evicted = target_rank(loaded, tasks.targets.context[copy][:, N - (D - 1):], target).numpy() == 0  # reads [n, D - 1]
    n = len(copy)
    top5 = int((rank < TOP_K).sum())
    candidates = [continuations(tasks.targets.context[i].tolist()) for i in copy]  # [n]
    both = {"model, source evicted": int(evicted.sum()),
            "either: evicted model or longest": int((evicted | right["longest"]).sum()),
            "either: full-cache model or longest": int((full | right["longest"]).sum())}
    doc = {"model": loaded.name, "model_sha256": loaded.content_sha256, "reference_context": N,
           "copy_rule": args.copy_rule, "n_copy_targets": n, "min_distance": D,
           "rules": {name: {"correct": h, "accuracy": h / n} for name, h in hits.items()},
           "model_full_cache": model,
           "model_source_evicted": {"window": D - 1, "correct": both["model, source evicted"],
                                    "accuracy": both["model, source evicted"] / n},
           "either_evicted_or_longest": {"correct": both["either: evicted model or longest"],
                                         "accuracy": both["either: evicted model or longest"] / n},
           "either_full_cache_or_longest": {"correct": both["either: full-cache model or longest"],
                                            "accuracy": both["either: full-cache model or longest"] / n},
           "model_full_cache_top5": {"correct": top5, "accuracy": top5 / n},
           "continuations_of_previous_token": {"median": float(np.median(candidates)) if n else float("nan"),
                                               "per_target": candidates}}
    print(f"copy targets of certify-attribution at N = {N}, rule {args.copy_rule}: {n}")
    for name, h in hits.items():
        print(f"  {name:9s} {h:3d} / {n} = {h / n:.0%}")
    print(f"  {'model':9s} {model['correct']:3d} / {n} = {model['accuracy']:.0%} (full-cache top-1, {loaded.name})")
    print(f"  model, source evicted (last D - 1 = {D - 1} tokens) {both['model, source evicted']:3d} / {n} = "
          f"{both['model, source evicted'] / n:.0%}")
    for name in ("either: evicted model or longest", "either: full-cache model or longest"):
        print(f"  {name} {both[name]:3d} / {n} = {both[name] / n:.0%}")
    print(f"  model, full cache, target in its top {TOP_K}  {top5:3d} / {n} = {top5 / n:.0%}")
    if n:
        print(f"  distinct tokens after earlier occurrences of the token before the target: median "
              f"{np.median(candidates):g} (range {min(candidates)}-{max(candidates)})")
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
