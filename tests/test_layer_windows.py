"""Prefill-evict with a window per layer: the per-layer masks equal a decode over a
cache pruned layer by layer (a naive per-layer evicting loop written here), to 1e-5; nothing windowed
is the model's own output; a sweep measures each layer alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from conftest import hybrid_qwen2, sharp_tiny_llama
from truncsens.engine.layer_windows_pass import (
    LayerMaskError, decode_layer_windows, layer_sweep_configurations, measure_layer_windows,
)
from truncsens.engine.reference_pass import reference_pass
from truncsens.targets import TargetSet


def pruned_decode(model, ids, cache, windows, n_sink, own_windows):
    """The naive reference: per layer, copy only the keys it keeps (sinks and the last w_l, within the
    layer's own sliding window) into a new cache; decode the last token against it, one sequence at a
    time, with no mask at all."""
    B, T = ids.shape
    rows = []
    for b in range(B):
        pruned = DynamicCache()
        for layer, (w, W) in enumerate(zip(windows, own_windows)):
            k, v = cache.layers[layer].keys[b : b + 1], cache.layers[layer].values[b : b + 1]
            keep = [j for j in range(T - 1) if (w is None or j < n_sink or T - 1 - j < w) and (W is None or T - 1 - j < W)]
            index = torch.tensor(keep, dtype=torch.long)
            pruned.update(k.index_select(2, index), v.index_select(2, index), layer)
        with torch.no_grad():
            out = model(input_ids=ids[b : b + 1, T - 1 :], position_ids=torch.tensor([[T - 1]]), cache=pruned,
                        use_cache=True).logits[:, -1]
        rows.append(out.double().log_softmax(-1))
    return torch.cat(rows)


def assert_close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.exp(), b.exp(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("windows", [[5, None, 9], [1, 3, 2], [None, None, 4]])
def test_per_layer_windows_equal_a_per_layer_pruned_cache(windows):
    model = sharp_tiny_llama(layers=3)
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    ref = reference_pass(model, ids, keep_cache=True)
    got = decode_layer_windows(model, ids, ref.cache, windows, 2)
    assert_close(got, pruned_decode(model, ids, ref.cache, windows, 2, [None] * 3))
    assert float((got - ref.logprobs).abs().max()) > 1e-3  # the windows changed the output
    assert_close(decode_layer_windows(model, ids, ref.cache, [None] * 3, 2), ref.logprobs)  # nothing windowed


def test_a_hybrid_sliding_window_model_keeps_its_own_windows():
    """Qwen2 with layers 1 and 2 sliding over 5 keys: a plan window wider than 5 changes nothing there."""
    model = hybrid_qwen2()
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(2))
    ref = reference_pass(model, ids, keep_cache=True)
    windows = [4, 8, None]
    got = decode_layer_windows(model, ids, ref.cache, windows, 1)
    assert_close(got, pruned_decode(model, ids, ref.cache, windows, 1, [None, 5, 5]))
    assert_close(decode_layer_windows(model, ids, ref.cache, [None, 12, 7], 1), ref.logprobs)


def test_sweep_layer_by_layer_and_errors():
    model = sharp_tiny_llama(layers=2)
    ids = torch.randint(0, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(3))
    targets = TargetSet(["a", "a", "b"], np.arange(3) + 24, ids, torch.zeros(3, dtype=torch.long))
    configs = layer_sweep_configurations(2, [2, 8, 23])
    assert configs[:3] == [[2, None], [8, None], [23, None]] and configs[3] == [None, 2]
    metrics, _ = measure_layer_windows(model, targets, configs, 1, "cpu", 10_000)
    kl = metrics["kl"].reshape(2, 3, 3)  # [layer, window, target]
    assert np.all(kl[:, 2] < 1e-10)  # window 23 of a 24-token context plus the sink key 0: nothing dropped
    assert kl[:, 0].min() > 1e-4  # window 2: every layer alone moves every target
    with pytest.raises(LayerMaskError, match="3 windows for a model of 2 layers"):
        decode_layer_windows(model, ids, reference_pass(model, ids, keep_cache=True).cache, [1, 2, 3], 1)
    with pytest.raises(LayerMaskError, match="at least 1 token"):
        decode_layer_windows(model, ids, reference_pass(model, ids, keep_cache=True).cache, [0, 2], 1)


def test_per_layer_support_and_path_are_the_semantics_attributes():
    from truncsens.engine.config import DEFAULT_PER_LAYER_SEMANTICS, PER_LAYER_SEMANTICS
    from truncsens.engine.semantics import SEMANTICS, PrefillEvict, Streaming

    assert PER_LAYER_SEMANTICS[0] == DEFAULT_PER_LAYER_SEMANTICS
    assert set(PER_LAYER_SEMANTICS) == {n for n, s in SEMANTICS.items() if s.per_layer} == {"prefill_evict", "streaming"}

    class Renamed(PrefillEvict):  # the same object under another name: only attributes decide
        name = "prefill_evict_copy"

    class StreamingRenamed(Streaming):
        name = "streaming_copy"

    model = sharp_tiny_llama(layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    targets = TargetSet(["a", "b"], np.arange(2) + 16, ids, torch.zeros(2, dtype=torch.long))
    configs = layer_sweep_configurations(2, [2, 6])
    for base, renamed in (("prefill_evict", Renamed()), ("streaming", StreamingRenamed())):
        tokens_base, tokens_renamed = [], []
        want, _ = measure_layer_windows(model, targets, configs, 1, "cpu", 10_000, tokens_base.append, semantics=base)
        got, _ = measure_layer_windows(model, targets, configs, 1, "cpu", 10_000, tokens_renamed.append, semantics=renamed)
        np.testing.assert_array_equal(got["kl"], want["kl"])
        # forward tokens: the reference pass (2 x 16), then 4 configurations of one decoded token or 16 streamed per row
        assert tokens_renamed == tokens_base == [2 * 16 + 4 * 2 * (1 if base == "prefill_evict" else 16)]

    class NoPerLayer(Streaming):
        name = "streaming_without"
        per_layer = False

    with pytest.raises(LayerMaskError, match="per-layer windows run under streaming or prefill_evict, not 'streaming_without'"):
        measure_layer_windows(model, targets, configs, 1, "cpu", 10_000, semantics=NoPerLayer(SEMANTICS))


def streaming_loop(model, ids, windows, n_sink):
    """Streaming with a window per layer, token by token: at step q each layer's cache holds only its
    sinks and last w_l earlier keys (keys as computed at their own step), copied from the stored keys;
    token q is run alone against it with no mask."""
    B, T = ids.shape
    rows = []
    for b in range(B):
        keys, values = {}, {}
        for q in range(T):
            cache = DynamicCache()
            if q:
                for layer, w in enumerate(windows):
                    keep = [j for j in range(q) if w is None or j < n_sink or q - j < w]
                    index = torch.tensor(keep, dtype=torch.long)
                    cache.update(keys[layer][:, :, :q].index_select(2, index), values[layer][:, :, :q].index_select(2, index), layer)
            with torch.no_grad():
                out = model(input_ids=ids[b : b + 1, q : q + 1], position_ids=torch.tensor([[q]]), cache=cache, use_cache=True)
            for layer in range(len(windows)):
                k, v = cache.layers[layer].keys, cache.layers[layer].values
                if layer not in keys:
                    keys[layer] = k.new_zeros(1, k.shape[1], T, k.shape[3])
                    values[layer] = v.new_zeros(1, v.shape[1], T, v.shape[3])
                keys[layer][:, :, q], values[layer][:, :, q] = k[:, :, -1], v[:, :, -1]
        rows.append(out.logits[:, -1].double().log_softmax(-1))
    return torch.cat(rows)


@pytest.mark.parametrize("windows", [[3, None, 6], [1, 2, 4]])
def test_streaming_per_layer_windows_equal_a_token_by_token_cache(windows):
    from truncsens.engine.layer_windows_pass import stream_layer_windows

    model = sharp_tiny_llama(layers=3)
    ids = torch.randint(0, model.config.vocab_size, (2, 18), generator=torch.Generator().manual_seed(6))
    got = stream_layer_windows(model, ids, windows, 1)
    assert_close(got, streaming_loop(model, ids, windows, 1))
    ref = reference_pass(model, ids)
    assert float((got - ref.logprobs).abs().max()) > 1e-3
    assert_close(stream_layer_windows(model, ids, [None] * 3, 1), ref.logprobs)


@pytest.mark.parametrize("make", ["llama", "hybrid_qwen2"])
def test_streaming_per_layer_windows_from_eviction_steps_equal_the_dense_masks(make, monkeypatch):
    """The eviction-step pass (no T × T mask) equals the fallback's per-layer [B, 1, T, T] masks,
    also with the model's own sliding windows (hybrid Qwen2)."""
    from truncsens.engine import layer_windows_pass

    model = sharp_tiny_llama(layers=3) if make == "llama" else hybrid_qwen2()
    ids = torch.randint(0, 60, (2, 30), generator=torch.Generator().manual_seed(7))
    windows = [4, None, 9]
    got = layer_windows_pass.stream_layer_windows(model, ids, windows, 2)
    monkeypatch.setattr(layer_windows_pass.evict_attention, "supported", lambda model, windows: False)
    dense = layer_windows_pass.stream_layer_windows(model, ids, windows, 2)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
    assert float((got - reference_pass(model, ids).logprobs).abs().max()) > 1e-3
