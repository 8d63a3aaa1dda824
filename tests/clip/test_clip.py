"""Clipping against independent oracles: the seed's worked example, NumPy, torch.nn.utils."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from steadytrain import reference
from steadytrain.clip import (
    clip_grad_global_norm_,
    clip_grad_per_param_norm_,
    clip_grad_value_,
    global_grad_norm,
)
from steadytrain.errors import UserError


def params_with_grads(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def seed_params() -> list[torch.nn.Parameter]:
    return params_with_grads([torch.tensor([3.0, 4.0]), torch.tensor([12.0])])


def random_params(seed: int = 0, dtype=torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,), (11,)]
    # Heterogeneous magnitudes, as between real layers.
    return params_with_grads([torch.randn(s, generator=gen).to(dtype) * 10.0**i for i, s in enumerate(shapes)])


# --- the seed's worked example, verbatim ------------------------------------------------------


def test_seed_example_global_norm():
    params = seed_params()
    norm = clip_grad_global_norm_(params, max_norm=1.0)
    torch.testing.assert_close(norm, torch.tensor(13.0))
    post = math.sqrt(sum(float((p.grad**2).sum()) for p in params))
    assert math.isclose(post, 1.0, rel_tol=1e-6)
    # The 5:12 ratio between the two parameters' norms is preserved.
    ratio = float(params[0].grad.norm() / params[1].grad.norm())
    assert math.isclose(ratio, 5.0 / 12.0, rel_tol=1e-6)


def test_seed_example_value_clip():
    params = seed_params()
    clip_grad_value_(params, clip_value=5.0)
    torch.testing.assert_close(params[0].grad, torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(params[1].grad, torch.tensor([5.0]))


def test_reference_module_matches_seed_numbers():
    grads = [np.array([3.0, 4.0]), np.array([12.0])]
    clipped, norm = reference.clip_grad_global_norm(grads, max_norm=1.0)
    assert np.isclose(norm, 13.0)
    assert np.isclose(np.sqrt(sum(np.sum(g**2) for g in clipped)), 1.0)
    by_value = reference.clip_grad_by_value(grads, clip_value=5.0)
    assert np.allclose(by_value[0], [3.0, 4.0]) and np.allclose(by_value[1], [5.0])


@pytest.mark.parametrize("max_norm", [0.01, 1.0, 1e6])
def test_global_clip_matches_numpy_reference(max_norm):
    params = random_params(1)
    grads_np = [p.grad.double().numpy() for p in params]
    expected, expected_norm = reference.clip_grad_global_norm(grads_np, max_norm)
    norm = clip_grad_global_norm_(params, max_norm)
    assert math.isclose(float(norm), expected_norm, rel_tol=1e-6)
    for p, e in zip(params, expected, strict=True):
        np.testing.assert_allclose(p.grad.numpy(), e, rtol=1e-5, atol=1e-7)


def test_value_clip_matches_numpy_reference():
    params = random_params(2)
    expected = reference.clip_grad_by_value([p.grad.numpy() for p in params], 0.5)
    clip_grad_value_(params, 0.5)
    for p, e in zip(params, expected, strict=True):
        np.testing.assert_array_equal(p.grad.numpy(), e)


# --- parity with torch.nn.utils.clip_grad_norm_ ------------------------------------------------


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, 0.5, math.inf])
@pytest.mark.parametrize("max_norm", [1e-3, 1.0, 50.0, 1e9])
def test_matches_torch_clip_grad_norm(norm_type, max_norm):
    assert_clips_as_torch(norm_type, max_norm)


def assert_clips_as_torch(norm_type, max_norm) -> None:
    """The pre-clip norm and the clipped gradients equal torch.nn.utils.clip_grad_norm_'s."""
    ours, theirs = random_params(3), random_params(3)
    norm = clip_grad_global_norm_(ours, max_norm, norm_type=norm_type)
    torch_norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type=norm_type)
    torch.testing.assert_close(norm, torch_norm, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-12)


# torch.nn.utils takes ``norm_type`` as a float or a string ("inf" in its own tests): the same spellings here.
TORCH_SPELLINGS = ["inf", "Infinity", "2", "2.0", " 3 ", "0.5", "1e0", 3]


@pytest.mark.parametrize("norm_type", TORCH_SPELLINGS)
@pytest.mark.parametrize("max_norm", [1e-3, 1e9])
def test_norm_type_spelled_as_torch_takes_it_matches_torch(norm_type, max_norm):
    assert_clips_as_torch(norm_type, max_norm)
    grads = [p.grad for p in random_params(4)]
    want = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
    torch.testing.assert_close(global_grad_norm(params_with_grads(grads), norm_type), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "norm_type",
    [True, False, "abc", "", "l2", None, math.nan, "nan", b"2", [2], torch.tensor(2.0), 0, "0", -1.0, "-2",
     -math.inf, "-inf", pytest.param(10**400, id="int-beyond-float")],
)  # fmt: skip
@pytest.mark.parametrize("fn", [global_grad_norm, lambda ps, nt: clip_grad_global_norm_(ps, 1.0, norm_type=nt)])
def test_norm_type_that_is_not_a_number_or_not_a_norm_is_one_line_user_error(fn, norm_type):
    params = seed_params()
    with pytest.raises(UserError, match="norm_type") as err:
        fn(params, norm_type)
    assert "\n" not in str(err.value) and len(str(err.value)) < 300
    # Refused before anything is touched.
    torch.testing.assert_close([p.grad for p in params], [p.grad for p in seed_params()], rtol=0, atol=0)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_global_norm_is_norm_of_concatenation(norm_type):
    params = random_params(4)
    flat = torch.cat([p.grad.flatten().double() for p in params])
    expected = torch.linalg.vector_norm(flat, norm_type)
    torch.testing.assert_close(global_grad_norm(params, norm_type).double(), expected, rtol=1e-6, atol=0)


# --- invariants -------------------------------------------------------------------------------


def test_below_threshold_grads_bit_identical():
    params = random_params(5)
    before = [p.grad.clone() for p in params]
    norm = global_grad_norm(params)
    clip_grad_global_norm_(params, max_norm=float(norm) * 2)
    for b, p in zip(before, params, strict=True):
        assert torch.equal(b, p.grad)


def test_clipping_twice_changes_nothing():
    params = random_params(6)
    clip_grad_global_norm_(params, max_norm=1.0)
    once = [p.grad.clone() for p in params]
    clip_grad_global_norm_(params, max_norm=1.0)
    for a, p in zip(once, params, strict=True):
        torch.testing.assert_close(p.grad, a, rtol=1e-6, atol=0)


def test_post_clip_norm_equals_max_norm():
    params = random_params(7)
    clip_grad_global_norm_(params, max_norm=0.25)
    assert math.isclose(float(global_grad_norm(params)), 0.25, rel_tol=1e-5)


def test_global_clip_preserves_direction():
    params = random_params(8)
    flat_before = torch.cat([p.grad.flatten() for p in params])
    clip_grad_global_norm_(params, max_norm=1.0)
    flat_after = torch.cat([p.grad.flatten() for p in params])
    cos = torch.nn.functional.cosine_similarity(flat_before.double(), flat_after.double(), dim=0)
    assert math.isclose(float(cos), 1.0, rel_tol=1e-9)


def test_per_param_differs_from_global_on_heterogeneous_layers():
    # One layer with a huge gradient, one with a small one: the classic bug.
    small, big = torch.tensor([0.3, 0.4]), torch.tensor([120.0, 50.0])
    per_param = params_with_grads([small, big])
    global_ = params_with_grads([small, big])
    norms = clip_grad_per_param_norm_(per_param, max_norm=1.0)
    clip_grad_global_norm_(global_, max_norm=1.0)
    torch.testing.assert_close(torch.stack(norms), torch.tensor([0.5, 130.0]))
    # Per-parameter: the small layer is untouched, the big one scaled to norm 1 on its own.
    assert torch.equal(per_param[0].grad, small)
    assert math.isclose(float(per_param[1].grad.norm()), 1.0, rel_tol=1e-5)
    # Global: both scaled by the same 1/130.4..., so the small layer nearly vanishes.
    scale = 1.0 / (math.hypot(0.5, 130.0) + 1e-6)
    torch.testing.assert_close(global_[0].grad, small * scale)
    assert not torch.allclose(per_param[0].grad, global_[0].grad)


def test_per_param_matches_torch_per_tensor():
    params, expected = random_params(9), random_params(9)
    clip_grad_per_param_norm_(params, max_norm=2.0)
    for e in expected:
        torch.nn.utils.clip_grad_norm_([e], 2.0)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, e.grad, rtol=1e-6, atol=1e-12)


# --- edges ------------------------------------------------------------------------------------


def test_parameters_without_grad_are_skipped():
    params = [*seed_params(), torch.nn.Parameter(torch.ones(3))]
    torch.testing.assert_close(global_grad_norm(params), torch.tensor(13.0))
    clip_grad_global_norm_(params, 1.0)
    assert params[-1].grad is None


def test_no_grads_at_all_is_zero():
    params = [torch.nn.Parameter(torch.ones(3))]
    norm = global_grad_norm(params)
    assert norm.dtype == torch.float32 and norm.ndim == 0 and float(norm) == 0.0
    assert float(clip_grad_global_norm_(params, 1.0)) == 0.0
    assert clip_grad_per_param_norm_(params, 1.0) == []


def test_zero_grads_stay_zero():
    params = params_with_grads([torch.zeros(4), torch.zeros(2, 2)])
    norm = clip_grad_global_norm_(params, 1.0)
    assert float(norm) == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p.grad)) for p in params)


def test_single_tensor_argument():
    p = seed_params()[0]
    torch.testing.assert_close(global_grad_norm(p), torch.tensor(5.0))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_non_finite_grad_gives_non_finite_norm(bad, norm_type):
    params = random_params(10)
    params[2].grad[0, 1, 1] = bad
    norm = global_grad_norm(params, norm_type)
    assert not torch.isfinite(norm)


def test_fp16_sum_of_squares_overflowing_fp16():
    # 300^2 * 16 = 1.44e6 > fp16 max (65504): squaring in fp16 would give inf.
    grads = [torch.full((16,), 300.0, dtype=torch.float16), torch.full((4,), -200.0, dtype=torch.float16)]
    params = params_with_grads(grads)
    norm = global_grad_norm(params)
    assert norm.dtype == torch.float32
    expected = math.sqrt(16 * 300.0**2 + 4 * 200.0**2)
    assert math.isclose(float(norm), expected, rel_tol=1e-6)
    clip_grad_global_norm_(params, max_norm=1.0)
    post = math.sqrt(sum(float((p.grad.float() ** 2).sum()) for p in params))
    assert math.isclose(post, 1.0, rel_tol=2e-3)  # fp16 storage resolution
    assert params[0].grad.dtype == torch.float16


def test_bf16_grads_accumulate_in_float32():
    grads = [torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)]
    norm = global_grad_norm(params_with_grads(grads))
    assert norm.dtype == torch.float32
    expected = float(torch.linalg.vector_norm(grads[0].double()))
    assert math.isclose(float(norm), expected, rel_tol=1e-6)


def test_mixed_dtypes():
    grads = [torch.tensor([3.0, 4.0], dtype=torch.float16), torch.tensor([12.0], dtype=torch.float64)]
    norm = global_grad_norm(params_with_grads(grads))
    assert norm.dtype == torch.float64  # never less precise than the most precise gradient
    assert float(norm) == 13.0


@pytest.mark.parametrize(
    ("fn", "kwargs", "word"),
    [
        (clip_grad_global_norm_, {"max_norm": -1.0}, "max_norm"),
        (clip_grad_value_, {"clip_value": -1.0}, "clip_value"),
        (clip_grad_per_param_norm_, {"max_norm": -1.0}, "max_norm"),
        (global_grad_norm, {"norm_type": 0.0}, "norm_type"),
    ],
)
def test_bad_arguments_name_the_field(fn, kwargs, word):
    with pytest.raises(ValueError, match=word):
        fn(seed_params(), **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_cpu_gradient_norm_is_float32_accurate(dtype):
    # A plain float32 reduction over millions of elements drifts by ~1e-4..1e-3 relative on CPU;
    # the global norm must stay within float32 accuracy of the float64 value.
    n = 8_000_000 + 77  # a tail that is not a multiple of the row length
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-2).to(dtype)
    params = params_with_grads([grad, torch.tensor([3.0, 4.0], dtype=dtype)])
    expected = math.sqrt(float(grad.double().pow(2).sum()) + 25.0)
    assert math.isclose(float(global_grad_norm(params)), expected, rel_tol=1e-5)
    norm1 = float(global_grad_norm(params, norm_type=1.0))
    assert math.isclose(norm1, float(grad.double().abs().sum()) + 7.0, rel_tol=1e-5)
