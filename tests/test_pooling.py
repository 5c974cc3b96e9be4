"""Tests for vit_jax.models.pooling: nn.max_pool's values and gradients, on the CPU path."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax.models import pooling


def _inputs(shape, dtype):
  rng = np.random.RandomState(0)
  x = rng.randn(*shape)
  # Ties within windows: zeros (what a ReLU before the pool leaves) and repeated values.
  x[rng.rand(*shape) < 0.3] = 0
  x[rng.rand(*shape) < 0.1] = 1.5
  return jnp.asarray(x, dtype)


def _gradient(pool, x, g):
  return jax.vjp(pool, x)[1](g)[0]


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('padding', ['SAME', 'VALID'])
@pytest.mark.parametrize('shape', [(2, 16, 16, 3), (2, 15, 17, 3)], ids=['even', 'odd'])
# The stems' 3x3/2, and windows that leave a phase of the backward empty (2x2/3) or have one
# phase only (3x3/1).
@pytest.mark.parametrize('window, stride', [(3, 2), (2, 2), (3, 1), (2, 3)])
def test_values_and_gradients_are_nn_max_pool(dtype, padding, shape, window, stride):
  x = _inputs(shape, dtype)
  reference = lambda x: nn.max_pool(x, (window, window), strides=(stride, stride), padding=padding)
  ours = lambda x: pooling._max_pool(x, window, stride, padding)  # pylint: disable=protected-access
  y = ours(x)
  assert y.dtype == dtype
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(reference(x), np.float32))
  g = jnp.asarray(np.random.RandomState(1).randn(*y.shape), dtype)
  # The reference in float32 (the same values): bf16's sums the overlapping windows in bf16
  # (up to 9 terms at stride 1), ours in float32 and rounds once.
  f32 = jnp.float32
  expected = np.asarray(_gradient(reference, x.astype(f32), g.astype(f32)))
  got = _gradient(ours, x, g)
  assert got.dtype == dtype
  # Overlapping windows sum in another order; a bf16 result is rounded once.
  tol = 1e-6 if dtype == jnp.float32 else 2.0**-8
  np.testing.assert_allclose(np.asarray(got, np.float32), expected, rtol=tol, atol=tol)
  # Each output's gradient goes to one position (the first maximum), as nn.max_pool's does:
  # where the gradient is zero in one it is zero in the other.
  np.testing.assert_array_equal(np.asarray(got, np.float32) == 0, expected == 0)


def test_the_stems_pool_on_this_cpu_is_the_custom_one():
  x = _inputs((1, 8, 8, 2), jnp.float32)
  hlo = jax.jit(jax.grad(lambda x: jnp.sum(pooling.max_pool(x, 3, 2, 'SAME')))).lower(x).as_text()
  assert 'select_and_scatter' not in hlo and 'reduce_window' not in hlo


def test_the_backward_sums_each_phase_at_the_output_size():
  # Each window offset's gradient spread to the input's size (pads with interior zeros)
  # and added nine times over had run 4x slower than each phase of the input summed at
  # the output's size and interleaved (benchmarks/README.md, fifty-sixth session).
  x = _inputs((1, 16, 16, 2), jnp.float32)
  hlo = jax.jit(jax.grad(lambda x: jnp.sum(pooling.max_pool(x, 3, 2, 'SAME')))).lower(x).as_text()
  interiors = re.findall(r'stablehlo\.pad .* interior = \[([\d, ]+)\]', hlo)
  assert interiors and all(
      set(i.replace(' ', '').split(',')) == {'0'} for i in interiors), interiors
