"""KernelOutput.zeros / record: the one place both kernels (exact and policy blocks) store a measurement."""

import math

import numpy as np
import torch

from truncsens.divergences import METRICS
from truncsens.engine.kernel import KernelOutput


def test_zeros_shapes_and_dtypes():
    out = KernelOutput.zeros(2, 3, 4, 5, evicted_mass=False)
    assert set(out.metrics) == set(METRICS)
    assert all(v.shape == (2, 3, 4, 5) for v in out.metrics.values())
    assert out.metrics["top1_agree"].dtype == np.int8 and out.metrics["tv"].dtype == np.float32
    assert out.kept_tokens.dtype == np.int32 and out.evicted_attention_mass is None and out.n_clamped == 0
    assert KernelOutput.zeros(1, 1, 1, 1, evicted_mass=True).evicted_attention_mass.dtype == np.float32


def test_record_writes_hand_computed_values_at_the_given_rows():
    out = KernelOutput.zeros(2, 2, 3, 2, evicted_mass=True)
    ref = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]], dtype=torch.float64))  # [b=2, V=2]
    kept = torch.log(torch.tensor([[0.75, 0.25], [0.9, 0.1]], dtype=torch.float64))
    keep = torch.tensor([[True, False, True, True], [True, True, True, True]])  # [b, N=4]
    attention = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    out.record(1, 1, [2, 0], 1, ref, kept, torch.tensor([0, 1]), keep, attention)
    tv = out.metrics["tv"][1, 1, :, 1]  # rows 2 and 0 written, row 1 untouched
    np.testing.assert_allclose(tv, [0.0, 0.0, 0.25], atol=1e-7)
    kl = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # KL(ref || kept) of the first pair
    np.testing.assert_allclose(out.metrics["kl"][1, 1, 2, 1], kl, rtol=1e-6)
    np.testing.assert_array_equal(out.kept_tokens[1, 1, :, 1], [4, 0, 3])
    np.testing.assert_allclose(out.evicted_attention_mass[1, 1, :, 1], [0.0, 0.0, 0.6], atol=1e-7)
    assert out.metrics["tv"][0].sum() == 0 and out.metrics["tv"][1, 0].sum() == 0  # other policy / draw untouched


def test_record_without_attention_leaves_the_mass_alone():
    out = KernelOutput.zeros(1, 1, 1, 1, evicted_mass=True)
    lp = torch.zeros(1, 3, dtype=torch.float64)
    out.record(0, 0, slice(0, 1), 0, lp, lp, torch.tensor([2]), torch.ones(1, 5, dtype=torch.bool))
    assert out.evicted_attention_mass[0, 0, 0, 0] == 0 and out.kept_tokens[0, 0, 0, 0] == 5
    assert out.metrics["top1_agree"][0, 0, 0, 0] == 1


def test_metric_arrays_and_store_metrics_at_a_numpy_index():
    from truncsens.engine.kernel import metric_arrays, store_metrics

    arrays = metric_arrays((3, 2))
    assert arrays["top1_agree"].dtype == np.int8 and arrays["kl"].shape == (3, 2)
    ref = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    kept = torch.log(torch.tensor([[0.9, 0.1]], dtype=torch.float64))
    assert store_metrics(arrays, (np.array([2]), 1), ref, kept, torch.tensor([1])) == 0
    np.testing.assert_allclose(arrays["tv"], [[0, 0], [0, 0], [0, 0.4]], atol=1e-7)
    np.testing.assert_allclose(arrays["nll_kept"][2, 1], -np.log(0.1), rtol=1e-6)


def test_rows_logprobs_are_the_last_rows_log_softmaxed_in_float64():
    from truncsens.engine.forward import rows_logprobs

    logits = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]]], dtype=torch.float32)  # [B=1, L=3, V=2]
    lp = rows_logprobs(logits, 2)  # rows 1 and 2
    assert lp.shape == (1, 2, 2) and lp.dtype == torch.float64
    np.testing.assert_allclose(lp[0, 0].exp().numpy(), [math.e / (math.e + 1), 1 / (math.e + 1)], rtol=1e-12)
    np.testing.assert_allclose(lp[0, 1].exp().numpy(), [1 / (1 + math.e ** 2), math.e ** 2 / (1 + math.e ** 2)], rtol=1e-12)
