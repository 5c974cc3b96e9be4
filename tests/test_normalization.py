"""Tests for vit_jax.models.normalization and activations.relu: flax's and jax.nn's values and
gradients, less kept for the backward pass."""
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import planned_memory
from vit_jax.models import activations
from vit_jax.models import normalization

# (input shape, groups): the hybrids' 32 groups, a group of one channel, odd positions.
_CASES = [((2, 6, 6, 64), 32), ((3, 5, 7, 32), 32), ((2, 9, 3, 12), 4), ((2, 4, 4, 8), 1)]


def _inputs(shape, dtype, seed=0):
  rng = np.random.RandomState(seed)
  # An offset and spread per channel, as a convolution's output has.
  x = rng.randn(*shape) * rng.uniform(0.5, 4, shape[-1]) + rng.uniform(-2, 2, shape[-1])
  return jnp.asarray(x, dtype)


def _parameters(shape, groups, dtype):
  params = nn.GroupNorm(num_groups=groups).init(jax.random.PRNGKey(0), _inputs(shape, dtype))
  rng = np.random.RandomState(1)
  return jax.tree.map(lambda p: p + jnp.asarray(rng.randn(*p.shape), p.dtype) * 0.3, params)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('shape,groups', _CASES)
def test_values_are_flax_group_norms_up_to_the_order_of_the_sums(dtype, shape, groups):
  x, params = _inputs(shape, dtype), _parameters(shape, groups, dtype)
  ours = normalization.GroupNorm(num_groups=groups, dtype=dtype)
  flax_norm = nn.GroupNorm(num_groups=groups, dtype=dtype)
  assert jax.tree.map(jnp.shape, ours.init(jax.random.PRNGKey(0),
                                           x)) == jax.tree.map(jnp.shape, params)
  y = jax.jit(ours.apply)(params, x)
  assert y.dtype == jnp.dtype(dtype)
  expected = np.asarray(jax.jit(flax_norm.apply)(params, x), np.float32)
  # float32: the statistics' sums in another order; bf16: then one rounding to bf16 apart.
  tol = 1e-5 if dtype == 'float32' else 2.0**-8
  np.testing.assert_allclose(np.asarray(y, np.float32), expected, rtol=tol,
                             atol=tol * np.max(np.abs(expected)))


@pytest.mark.parametrize('shape,groups', _CASES)
def test_statistics_are_each_groups_mean_and_variance(shape, groups):
  x = _inputs(shape, 'float32')
  view = x.reshape(shape[0], -1, shape[-1])
  mean, var = jax.jit(normalization._statistics, static_argnums=1)(view, groups)
  grouped = np.asarray(view, np.float64).reshape(shape[0], view.shape[1], groups, -1)
  np.testing.assert_allclose(mean, grouped.mean((1, 3)), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(var, grouped.var((1, 3)), rtol=1e-5)


def _reductions(lowered_text):
  """(input shape, reduced axes) of each reduction in a lowered (StableHLO) program."""
  found = re.findall(
      r'stablehlo\.reduce\(.*? across dimensions = \[([\d, ]*)\] : '
      r'\(tensor<((?:\d+x)*)\w+>', lowered_text)
  return [(tuple(int(d) for d in shape.split('x') if d), tuple(int(a) for a in axes.split(',')))
          for axes, shape in found]


def _channel_axes(shape, channels):
  """The trailing axes of `shape` that hold the channels (one, or a group and its channels)."""
  axes, size = [], 1
  while size < channels:
    axes.append(len(shape) - 1 - len(axes))
    size *= shape[axes[-1]]
  return set(axes)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_sums_over_input_sized_arrays_keep_every_channel(dtype):
  # XLA:CPU runs a reduction over the positions and the group's channels together (the
  # group axis kept between reduced ones) 5-10x slower than per-channel sums (module doc).
  shape = (2, 6, 6, 64)  # the R50 root's 32 groups of 2 channels
  x, params = _inputs(shape, dtype), _parameters(shape, 32, dtype)
  reduces_a_channel = lambda reduction: (math.prod(reduction[0]) == x.size and bool(
      _channel_axes(reduction[0], shape[-1]) & set(reduction[1])))
  norm = normalization.GroupNorm(dtype=dtype)
  gradient = lambda p, x: jax.vjp(norm.apply, p, x)[1](jnp.ones(shape, dtype))
  reductions = _reductions(jax.jit(gradient).lower(params, x).as_text())
  assert sum(math.prod(a) == x.size for a, _ in reductions) >= 3, reductions
  assert not any(map(reduces_a_channel, reductions)), reductions
  # flax's own does reduce so, which is what this test tells apart.
  flax_norm = nn.GroupNorm(num_groups=32, dtype=dtype)
  assert any(
      map(reduces_a_channel, _reductions(jax.jit(flax_norm.apply).lower(params, x).as_text())))


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('shape,groups', _CASES)
def test_gradients_are_flax_group_norms(dtype, shape, groups):
  x, params = _inputs(shape, dtype), _parameters(shape, groups, dtype)
  g = _inputs(shape, dtype, seed=2)

  def gradients(module):
    y, vjp = jax.vjp(module.apply, params, x)
    return jax.jit(vjp)(g.astype(y.dtype))

  ours = gradients(normalization.GroupNorm(num_groups=groups, dtype=dtype))
  expected = gradients(nn.GroupNorm(num_groups=groups, dtype=dtype))
  (d_params, d_x), (expected_params, expected_x) = ours, expected
  assert d_x.dtype == x.dtype
  for name in ('scale', 'bias'):
    got, want = d_params['params'][name], expected_params['params'][name]
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(want))))
  # bf16: the input gradient is rounded to bf16 once here, and from other float32 sums.
  tol = 1e-5 if dtype == 'float32' else 2.0**-7
  scale = float(jnp.max(jnp.abs(expected_x.astype(jnp.float32))))
  np.testing.assert_allclose(np.asarray(d_x, np.float32), np.asarray(expected_x, np.float32),
                             rtol=tol, atol=tol * scale)


def test_zero_initialised_scale_is_passed_through():
  # The hybrids' last GroupNorm of each unit starts at zero: the unit is the identity.
  x = _inputs((2, 4, 4, 64), 'float32')
  norm = normalization.GroupNorm(scale_init=nn.initializers.zeros)
  params = norm.init(jax.random.PRNGKey(0), x)
  np.testing.assert_array_equal(params['params']['scale'], np.zeros(64, np.float32))
  np.testing.assert_array_equal(norm.apply(params, x), np.zeros(x.shape, np.float32))


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_groups_that_do_not_divide_the_channels_are_refused_as_flax_does(dtype):
  with pytest.raises(ValueError, match=r'Number of groups \(32\) does not divide'):
    normalization.GroupNorm(dtype=dtype).init(jax.random.PRNGKey(0), jnp.ones((1, 2, 2, 48), dtype))


def _kept(function, *args):
  """The arrays `function`'s vjp keeps for the backward pass."""
  return [a for a in jax.tree.leaves(jax.vjp(function, *args)[1]) if hasattr(a, 'shape')]


def test_a_bf16_backward_keeps_the_input_and_per_group_statistics():
  shape = (2, 6, 6, 64)
  x, params = _inputs(shape, 'bfloat16'), _parameters(shape, 32, 'bfloat16')
  kept = _kept(normalization.GroupNorm(dtype='bfloat16').apply, params, x)
  # One array of the input's size, the bf16 input; flax's autodiff keeps float32 ones.
  assert [a.dtype for a in kept if a.size == x.size] == [jnp.bfloat16], kept
  # Besides: the scale (64) and a mean and an inverse std per example and group (2 x 32).
  assert sorted(a.size for a in kept if a.size != x.size) == [64, 64, 64], kept
  flax_kept = _kept(nn.GroupNorm(dtype='bfloat16').apply, params, x)
  assert any(a.dtype == jnp.float32 and a.size == x.size for a in flax_kept), flax_kept


def test_a_float32_backward_keeps_no_more_than_flaxs():
  # Autodiff's backward for a float32 input, which keeps nothing wider than the input.
  shape = (2, 6, 6, 64)
  x, params = _inputs(shape, 'float32'), _parameters(shape, 32, 'float32')
  nbytes = lambda kept: sum(a.size * a.dtype.itemsize for a in kept)
  ours = _kept(normalization.GroupNorm().apply, params, x)
  assert all(a.dtype == jnp.float32 for a in ours), ours
  assert nbytes(ours) <= nbytes(_kept(nn.GroupNorm().apply, params, x))


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_relu_values_and_gradients_are_jax_nn_relus_and_it_keeps_its_output(dtype):
  x = jnp.asarray([[-2.0, -0.0, 0.0, 0.5, 3.0], [1.0, -1.0, 0.0, 2.0, -0.25]], dtype)
  g = jnp.asarray(np.arange(1, 11).reshape(2, 5), dtype)
  y = activations.relu(x)
  np.testing.assert_array_equal(y, jax.nn.relu(x))
  np.testing.assert_array_equal(
      jax.vjp(activations.relu, x)[1](g)[0],
      jax.vjp(jax.nn.relu, x)[1](g)[0])  # zero where x <= 0, jax.nn.relu's at 0 too
  kept = _kept(activations.relu, x)
  assert len(kept) == 1 and np.array_equal(kept[0], y), kept


def test_the_bf16_resnet_step_plans_less_memory_than_with_flax_and_jax_nn(monkeypatch):
  lean = planned_memory.resnet_step_temporaries_mb('bfloat16')
  monkeypatch.setattr(normalization, 'GroupNorm', nn.GroupNorm)
  monkeypatch.setattr(activations, 'relu', jax.nn.relu)
  before = planned_memory.resnet_step_temporaries_mb('bfloat16')
  # 10.9 vs 12.4 MB under the suite's XLA:CPU flags (10.9 vs 15.9 under the CLI's here).
  assert lean < 0.92 * before, (lean, before)
