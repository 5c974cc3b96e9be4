"""Tests for vit_jax.models.activations: jax.nn's values, their gradients, less kept."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import planned_memory
from vit_jax.models import activations
from vit_jax.models import attention
from vit_jax.models import vit


def _inputs(dtype, shape=(4, 5, 300), scale=4.0):
  # Wide enough to reach GELU's tails (|x| > 10) and its curved middle.
  return jnp.asarray(np.random.RandomState(0).randn(*shape) * scale, dtype)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_gelu_forward_is_jax_nn_gelu_in_float32_rounded_once(dtype):
  x = _inputs(dtype)
  y = activations.gelu(x)
  assert y.dtype == dtype
  in_float32 = jax.nn.gelu(x.astype(jnp.float32), approximate=True)
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.asarray(in_float32.astype(dtype), np.float32))
  if dtype == jnp.bfloat16:  # jax.nn.gelu in bf16 rounds each of its operations
    error = lambda y: np.abs(np.asarray(y, np.float32) - np.asarray(in_float32))
    assert error(y).max() < error(jax.nn.gelu(x, approximate=True)).max()


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_gelu_gradient_is_the_float32_derivative(dtype):
  # The reference: autodiff of jax.nn.gelu in float32 at the same (rounded) inputs; a bf16
  # gradient is that, rounded once (relative error <= 2^-8). Where the slope crosses zero
  # (x near -0.75 and in the far negative tail) the two float32 formulas differ by ~1e-5.
  x = _inputs(dtype)
  g = _inputs(dtype, scale=1.0) + 2
  reference = jax.vjp(lambda x: jax.nn.gelu(x, approximate=True),
                      x.astype(jnp.float32))[1](g.astype(jnp.float32))[0]
  grad = jax.vjp(activations.gelu, x)[1](g)[0]
  assert grad.dtype == dtype
  tol = 1e-5 if dtype == jnp.float32 else 2.0**-8
  np.testing.assert_allclose(np.asarray(grad, np.float32), reference, rtol=tol, atol=3e-5)


def test_softmax_values_and_gradients_are_jax_nn_softmax():
  logits = _inputs(jnp.float32, (3, 2, 7, 7))
  g = _inputs(jnp.float32, (3, 2, 7, 7), scale=1.0)
  np.testing.assert_array_equal(activations.softmax(logits), jax.nn.softmax(logits, axis=-1))
  expected = jax.vjp(lambda x: jax.nn.softmax(x, axis=-1), logits)[1](g)[0]
  np.testing.assert_allclose(
      jax.vjp(activations.softmax, logits)[1](g)[0], expected, rtol=1e-5, atol=1e-6)


def _saved_shapes(dtype, capsys):
  """Shapes of the values an encoder block keeps for its backward pass."""
  block = vit.EncoderBlock(mlp_dim=24, num_heads=2, dtype=dtype)
  x = _inputs(jnp.float32, (2, 5, 8))
  params = block.init(jax.random.PRNGKey(0), x, True)
  jax.ad_checkpoint.print_saved_residuals(lambda p, x: jnp.sum(block.apply(p, x, True)), params, x)
  out = capsys.readouterr().out
  return [m for m in re.findall(r'(?:f32|bf16)\[([\d,]+)\]', out)]


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_encoder_block_keeps_one_array_per_activation(dtype, capsys):
  # The MLP keeps GELU's input and output (Dense_1's input); jax.nn.gelu's autodiff kept
  # four more arrays that size. The attention keeps its weights once (softmax's output,
  # the next dot's operand), or none where attention.py recomputes them; softmax alone
  # keeps its output and nothing else.
  shapes = _saved_shapes(jnp.dtype(dtype), capsys)
  assert shapes.count('2,5,24') == 2, shapes
  assert shapes.count('2,2,5,5') == (0 if attention.recomputes(jnp.dtype(dtype)) else 1), shapes
  logits = _inputs(jnp.float32, (2, 2, 5, 5))
  kept = jax.tree.leaves(jax.vjp(activations.softmax, logits)[1])
  assert [x.shape for x in kept] == [(2, 2, 5, 5)], kept


@pytest.mark.parametrize('dtype,fraction', [('float32', 0.98), ('bfloat16', 0.9)])
def test_the_compiled_step_plans_less_memory_than_with_jax_nn(dtype, fraction, monkeypatch):
  # Under the suite's XLA:CPU flags (YNNPACK off): 69.6 vs 72.0 MB in float32, 63.3 vs
  # 73.2 MB in bfloat16 (with YNNPACK on: 60.9 vs 68.8, 42.9 vs 59.8).
  lean = planned_memory.vit_step_temporaries_mb(dtype)
  monkeypatch.setattr(activations, 'gelu', lambda x: jax.nn.gelu(x, approximate=True))
  monkeypatch.setattr(activations, 'softmax', lambda x: jax.nn.softmax(x, axis=-1))
  assert lean < fraction * planned_memory.vit_step_temporaries_mb(dtype)
