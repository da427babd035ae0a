"""The copy rules of benchmarks/copy_oracle.py on hand-made contexts (why the reference model misses copy targets)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("copy_oracle", Path(__file__).parents[1] / "benchmarks" / "copy_oracle.py")
copy_oracle = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(copy_oracle)


def test_suffix_rule_takes_the_most_recent_occurrence():
    #          0  1  2  3  4  5  6  7  8
    context = [5, 1, 7, 9, 1, 8, 3, 2, 1]
    assert copy_oracle.suffix_rule(context, 1) == 8  # last "1" before the end is at 4, followed by 8 (not 7)
    assert copy_oracle.suffix_rule(context, 2) is None  # (2, 1) never occurred before
    assert copy_oracle.suffix_rule([4, 2, 1, 6, 3, 2, 1], 2) == 6  # (2, 1) at 1..2, followed by 6


def test_longest_rule_prefers_the_longer_match_over_the_recent_one():
    context = [3, 2, 1, 7, 0, 1, 8, 4, 3, 2, 1]
    assert copy_oracle.suffix_rule(context, 1) == 8  # the most recent "1" (at 5) is followed by 8
    assert copy_oracle.longest_rule(context) == 7  # "3 2 1" at 0..2 matches three tokens: followed by 7
    assert copy_oracle.longest_rule([1, 2, 3]) is None  # the last token never occurred before


def test_continuations_counts_the_distinct_tokens_after_the_last_token():
    #          0  1  2  3  4  5  6  7  8
    context = [1, 7, 1, 8, 2, 1, 7, 3, 1]
    assert copy_oracle.continuations(context) == 2  # "1" at 0, 2, 5 is followed by 7, 8, 7
    assert copy_oracle.continuations([4, 5, 6]) == 0  # "6" never occurred before
    assert copy_oracle.continuations([6, 6, 6]) == 1  # "6" followed by "6" twice


def test_target_rank_equals_a_loop_of_single_forwards():
    """target_rank batches the contexts; each row's rank is the number of logits above the target's
    when the row is read alone (0: top-1), for targets chosen to give distinct ranks."""
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)).eval()
    contexts = torch.randint(0, 50, (5, 12))  # [n, L]
    loaded = SimpleNamespace(model=model, device=torch.device("cpu"))
    with torch.no_grad():
        order = [model(input_ids=row[None]).logits[0, -1].argsort(descending=True) for row in contexts]  # [V] each
    wanted = [0, 3, 1, 49, 7]  # the rank each row's target is given
    targets = torch.stack([o[r] for o, r in zip(order, wanted)])  # [n]
    got = copy_oracle.target_rank(loaded, contexts, targets, batch=2)
    assert got.tolist() == wanted
