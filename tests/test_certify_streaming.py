"""Certificates in a streaming cache (``certify --semantics streaming``).

The engine's streaming run is held to a loop written here: one sequence at a time, token by token,
through the Llama's own modules (norms, projections, rotary embedding, MLP), each layer and key/value
head holding its own cache of kept positions with their inclusion probabilities; the attention of
the kept keys (Hájek offsets), the truth over every key computed, the variance estimate and the
empirical-Bernstein radius are written out from their formulas (docs/method.md, section 5).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import sharp_tiny_llama
from truncsens.certificates.designs import CertifyDesign, layer_head_seeds
from truncsens.certificates.stream_passes import stream_run
from truncsens.policies import make_policy
from truncsens.policies.base import StreamView, uniforms


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


@torch.no_grad()
def loop_certificates(model, ids: torch.Tensor, policy, budget: int, seed: int, delta: float, design: CertifyDesign):
    """Stream one sequence ``ids`` [T] through ``model`` (float64) token by token; every (layer, KV
    head) keeps its own set of positions, decided by ``policy.evict`` from this loop's own window
    scores. Returns, at the last token, per layer [H] tensors: o_hat [H, d], variance, radius, error."""
    cfg = model.config
    L, H, Hkv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // H
    G = H // Hkv
    T = ids.numel()
    W = design.obs_window
    u = uniforms(layer_head_seeds([seed], L, Hkv), (T,), "cpu").view(L, Hkv, T)  # [L, Hkv, T]
    keys = [[[] for _ in range(Hkv)] for _ in range(L)]  # every key computed, per layer and KV head
    values = [[[] for _ in range(Hkv)] for _ in range(L)]
    kept = [[{} for _ in range(Hkv)] for _ in range(L)]  # position -> [pi, drawn, offset]
    ever_drawn = [[set() for _ in range(Hkv)] for _ in range(L)]
    rows = [[[] for _ in range(Hkv)] for _ in range(L)]  # attention rows paid by each query (this run's)
    inner = model.model
    out = None
    for t in range(T):
        x = inner.embed_tokens(ids[t : t + 1].view(1, 1))  # [1, 1, hidden]
        pos = torch.tensor([[t]])
        cos, sin = inner.rotary_emb(x, pos)  # [1, 1, d]
        last = t == T - 1
        records = []
        for layer, block in enumerate(inner.layers):
            att = block.self_attn
            hn = block.input_layernorm(x)
            q = _rotate(att.q_proj(hn).view(H, d), cos[0], sin[0])  # [H, d]
            k = _rotate(att.k_proj(hn).view(Hkv, d), cos[0], sin[0])  # [Hkv, d]
            v = att.v_proj(hn).view(Hkv, d)  # [Hkv, d]
            o_heads, rec = [], {"o_hat": [], "variance": [], "radius": [], "error": []}
            for h in range(Hkv):
                keys[layer][h].append(k[h])
                values[layer][h].append(v[h])
                kept[layer][h][t] = [1.0, False, 0.0]
                K_all, V_all = torch.stack(keys[layer][h]), torch.stack(values[layer][h])  # [t+1, d]
                slots = sorted(kept[layer][h])
                paid = torch.zeros(t + 1, dtype=torch.float64)
                for g in range(G):
                    qh = q[h * G + g]
                    logit = K_all @ qh / math.sqrt(d)  # [t+1]
                    o = torch.softmax(logit, 0) @ V_all  # truth: every key computed
                    w = {j: math.exp(float(logit[j])) / kept[layer][h][j][0] for j in slots}  # w_i / pi_i
                    z = sum(w.values())
                    o_hat = sum(w[j] * V_all[j] for j in slots) / z
                    o_heads.append(o_hat)
                    for j in slots:
                        paid[j] += w[j] / z
                    if last:
                        tail = [j for j in slots if kept[layer][h][j][1]]
                        exp_logit = {j: math.exp(float(logit[j])) for j in slots}
                        var = sum((1 - kept[layer][h][j][0]) / kept[layer][h][j][0] ** 2 * exp_logit[j] ** 2
                                  * float(((V_all[j] - o_hat) ** 2).sum()) for j in tail) / z ** 2
                        rng = max((exp_logit[j] * float((V_all[j] - o_hat).norm()) / (kept[layer][h][j][0] * z)
                                   for j in tail), default=0.0)
                        n = len(tail)
                        lg = math.log(4 / delta)
                        if not ever_drawn[layer][h]:
                            radius = 0.0
                        elif n < 2:
                            radius = math.inf
                        else:
                            radius = math.sqrt(2 * var * lg) + 7 * rng * lg * n / (3 * (n - 1))
                        rec["o_hat"].append(o_hat)
                        rec["variance"].append(var)
                        rec["radius"].append(radius)
                        rec["error"].append(float((o_hat - o).norm()))
                rows[layer][h].append(paid)
                if not last:  # the cache's decision after this token, from this loop's own statistics
                    end = t + 1
                    window = torch.zeros(end, dtype=torch.float64)
                    for r in rows[layer][h][-W:]:
                        window[: r.numel()] += r
                    s = design.tempered(window)
                    alive = torch.zeros(1, end, dtype=torch.bool)
                    alive[0, slots] = True
                    s = s + SCORE_FLOOR * float(s[slots].mean())
                    view = StreamView(alive, torch.tensor([[kept[layer][h].get(j, [1, False, 0.0])[2] for j in range(end)]]),
                                      torch.tensor([[j in ever_drawn[layer][h] for j in range(end)]]), budget, end,
                                      u[layer, h, :end].unsqueeze(0), accumulated=s.unsqueeze(0),
                                      pi=torch.tensor([[kept[layer][h].get(j, [1.0])[0] for j in range(end)]],
                                                      dtype=torch.float64))
                    step = policy.evict(view)
                    for j in range(end):
                        if step.drawn[0, j]:
                            ever_drawn[layer][h].add(j)
                    kept[layer][h] = {j: [float(step.pi[0, j]), bool(step.drawn[0, j]), float(step.offset[0, j])]
                                      for j in range(end) if step.keep[0, j]}
            if last:
                records.append(rec)
            attn = att.o_proj(torch.stack(o_heads).reshape(1, 1, H * d))
            x = x + attn
            x = x + block.mlp(block.post_attention_layernorm(x))
        out = records
    return out


SCORE_FLOOR = 1e-6


@pytest.mark.parametrize("budget", [6, 10])
def test_streaming_certificates_equal_a_token_loop(budget):
    """ô, V̂, the EB radius and the true error of the engine's streaming run equal the loop's, per
    layer and query head, to 1e-6 (float64), and the run actually thinned keys (random keys kept)."""
    model = sharp_tiny_llama().double()
    T, delta = 28, 0.1
    ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(3))
    design = CertifyDesign(obs_window=4, temper=0.5)
    policy = make_policy("poisson", n_sink=1)
    run = stream_run(model, ids, policy, budget, [11, 12], delta, design)
    got = run.steps[-1]
    thinned = 0
    for b in range(2):
        want = loop_certificates(model, ids[b], policy, budget, [11, 12][b], delta, design)
        for layer, rec in enumerate(want):
            for head in range(4):
                assert got["error"][b, layer, head].item() == pytest.approx(rec["error"][head], rel=1e-6, abs=1e-9)
                assert got["variance"][b, layer, head].item() == pytest.approx(rec["variance"][head], rel=1e-6, abs=1e-12)
                assert got["radius_eb"][b, layer, head].item() == pytest.approx(rec["radius"][head], rel=1e-6, abs=1e-9)
                assert got["o_hat_norm"][b, layer, head].item() == pytest.approx(float(rec["o_hat"][head].norm()), rel=1e-6)
        thinned += int(got["n_random"][b].sum())
    assert thinned > 0  # random keys were kept: the certificate is not vacuous
    assert float(got["error"].max()) > 1e-3  # eviction moved the outputs: the test can fail


def test_a_streamed_trajectory_is_the_stream_of_its_own_tokens():
    """Step t of ``streamed_trajectory`` is read from the cache that streamed the prefix and the t − 1
    tokens generated before: it equals a streaming run over that sequence (the same seed, so the same
    uniforms per position), record by record; the generated tokens are that run's top-1."""
    from truncsens.certificates.trajectory import streamed_trajectory
    from truncsens.targets import doc_seed

    model = sharp_tiny_llama().double()
    prefix = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(5))
    design = CertifyDesign(obs_window=4, temper=0.5)
    policy = make_policy("poisson", n_sink=1)
    traj = streamed_trajectory(model, prefix, policy, 8, 3, 0.1, seed=7, design=design)
    assert traj.tokens.numel() == 3 and traj.error.shape == (3, 2, 4)
    seq = prefix
    for t in range(3):
        run = stream_run(model, seq.unsqueeze(0), policy, 8, [doc_seed(7, "trajectory:stream")], 0.1, design)
        assert int(run.logprobs[0].argmax()) == int(traj.tokens[t])
        torch.testing.assert_close(torch.as_tensor(traj.error[t]), run.steps[-1]["error"][0].cpu(), rtol=1e-9, atol=1e-12)
        seq = torch.cat([seq, traj.tokens[t : t + 1]])
    assert traj.has_tail.any()  # random keys were kept at some step: the radii are not all zero



def test_kept_tokens_are_each_sequences_mean_over_its_layers_and_heads():
    """``kept_per_sequence`` reads row ``b·Hkv + h`` of every layer as sequence b's head h: here
    sequence b keeps b + 1 keys in layer 0 and b + 3 in layer 1 on each of its 3 heads (mean b + 2),
    with more rows (5 · 3) than positions (12), where slicing rows for positions once failed."""
    from truncsens.certificates.stream_passes import kept_per_sequence

    L, B, Hkv, T = 2, 5, 3, 12
    alive = torch.zeros(L, B * Hkv, T, dtype=torch.bool)
    for layer in range(L):
        for b in range(B):
            alive[layer, b * Hkv : (b + 1) * Hkv, : b + 1 + 2 * layer] = True
    assert kept_per_sequence(alive, B).tolist() == [2, 3, 4, 5, 6]


def test_a_batch_of_more_rows_than_positions_streams_as_its_sequences_alone():
    """Many short targets in one batch (B·Hkv > T): every sequence's log-probabilities and kept-token
    counts equal those of its own stream run alone (the same seeds)."""
    from truncsens.certificates.stream_passes import certify_stream_batch

    model = sharp_tiny_llama().double()
    B, T, budget = 10, 16, 6  # 10 sequences x 2 KV heads = 20 rows > 16 positions
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(5))
    policies = [make_policy("poisson", n_sink=1), make_policy("sink_recent", n_sink=1)]
    seeds = [[list(range(100 + 10 * p, 100 + 10 * p + B))] for p in range(len(policies))]
    design = CertifyDesign(obs_window=4, temper=0.5)
    batch = certify_stream_batch(model, ids, policies, [budget], seeds, 0.1, design)
    assert batch.kept_tokens.shape == (2, 1, B)
    for b in range(0, B, 3):
        one = certify_stream_batch(model, ids[b : b + 1], policies, [budget],
                                   [[[seeds[p][0][b]]] for p in range(len(policies))], 0.1, design)
        assert batch.kept_tokens[:, 0, b].tolist() == one.kept_tokens[:, 0, 0].tolist()
        torch.testing.assert_close(batch.logprobs[:, 0, b], one.logprobs[:, 0, 0], rtol=1e-9, atol=1e-9)
    assert batch.kept_tokens[1].unique().tolist() == [budget]  # sink_recent: exactly k keys in every head


@pytest.mark.parametrize("score,granularity,slack", [("window", "head", 2), ("h2o", "head", 32), ("key_norm", "head", 2),
                                                     ("window", "token", 32), ("h2o", "token", 2)])
def test_the_compacted_stream_equals_the_full_position_path(score, granularity, slack, monkeypatch):
    """The engine holds its streaming state for the live slots only (O(k) per token step); the path
    it replaced held every position and masked every key at every step (tests/stream_reference.py).
    Both give the same runs: log-probabilities, every step's records (generation included, so several
    recorded steps), kept-key counts and the design records, to 1e-6 in float64, for several seeds,
    both design granularities, poisson and sink_recent, with slots compacted after a few dead ones
    (slack 2) or left masked (slack 32)."""
    from stream_reference import reference_stream_run
    from truncsens.certificates import stream_probe
    from truncsens.certificates.stream_passes import kept_per_sequence

    monkeypatch.setattr(stream_probe, "COMPACT_SLACK", slack)

    model = sharp_tiny_llama(layers=3).double()
    T, budget, delta = 40, 9, 0.1
    design = CertifyDesign(granularity=granularity, score=score, obs_window=4, temper=0.5)
    for name, seeds in (("poisson", [21, 22, 23]), ("poisson", [5, 6, 7]), ("sink_recent", [1, 2, 3])):
        policy = make_policy(name, n_sink=1)
        ids = torch.randint(0, 64, (3, T), generator=torch.Generator().manual_seed(seeds[0]))
        new = stream_run(model, ids, policy, budget, seeds, delta, design, generate=3)
        old = reference_stream_run(model, ids, policy, budget, seeds, delta, design, generate=3)
        torch.testing.assert_close(new.logprobs, old.logprobs, rtol=1e-6, atol=1e-9)
        assert torch.equal(new.generated, old.generated)
        assert len(new.steps) == len(old.steps) == 3
        for got, want in zip(new.steps, old.steps):
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-9, equal_nan=True, msg=key)
        kept = new.state.by_position(T + 2)["alive"]
        assert torch.equal(kept, old.state.alive[:, :, : T + 2])  # the same keys cached, per layer and head
        assert kept_per_sequence(kept, 3).tolist() == kept_per_sequence(old.state.alive, 3).tolist()
        got, want = new.state.design_records(3, T + 2), old.state.design_records(3, T + 2)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-9, msg=key)
        if name == "poisson":  # the draws thinned keys, and rows hold different numbers of keys
            assert float(new.steps[-1]["n_random"].sum()) > 0
            assert kept.sum(-1).unique().numel() > 1
        assert new.state.n <= 2 * budget + slack  # the state holds the live slots (and a few dead), not T positions
