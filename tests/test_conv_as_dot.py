"""Tests for vit_jax.models.conv_as_dot: every path is the convolution, values and gradients."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax.models import conv_as_dot
from vit_jax.models import precision
from vit_jax.models import vit

# (input shape, kernel size, strides, padding): the ResNets' 3x3 at stride 1 and 2 over even
# and odd maps, BiT's symmetric explicit padding, patch embeddings with and without a
# remainder to drop, 1x1 kernels.
CASES = [
    ((2, 8, 8, 32), (3, 3), (1, 1), 'SAME'),
    ((2, 9, 9, 32), (3, 3), (2, 2), 'SAME'),
    ((2, 8, 8, 32), (3, 3), (2, 2), 'SAME'),
    ((2, 8, 8, 32), (3, 3), (2, 2), ((1, 1), (1, 1))),
    ((2, 16, 16, 3), (4, 4), (4, 4), 'VALID'),
    ((2, 18, 17, 3), (4, 4), (4, 4), 'VALID'),
    ((2, 9, 9, 8), (1, 1), (2, 2), 'SAME'),
]


def _rounded(x, dtype):
  """x as `dtype` holds it, in float32: the reference then sees no input rounding."""
  return jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32)


def _reference(x, kernel, strides, padding):
  return jax.lax.conv_general_dilated(x, kernel, strides, padding,
                                      dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
                                      precision='highest')


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['float32', 'bfloat16'])
@pytest.mark.parametrize('shape,kernel_size,strides,padding', CASES)
def test_conv_is_the_convolution_values_and_gradients(shape, kernel_size, strides, padding, dtype):
  # With operands bf16 holds exactly, a bf16 model's dots (float32 accumulation) give the
  # float32 convolution's values and gradients to float32 round-off. A bf16 convolution
  # that stays XLA's (overlapping windows off the CPU) rounds its results to bf16.
  rng = np.random.RandomState(0)
  x = _rounded(rng.randn(*shape), dtype)
  kernel = _rounded(rng.randn(*kernel_size, shape[-1], 16) * 0.1, dtype)
  overlapping = kernel_size != (1, 1) and (kernel_size != strides or padding != 'VALID')
  a_dot = not overlapping or conv_as_dot.im2col_pays(jnp.dtype(dtype), kernel, x)
  tol = 1e-5 if dtype == jnp.float32 or a_dot else 2e-2
  ours = lambda x, k: conv_as_dot.conv(x, k, strides, padding, dtype).astype(jnp.float32)
  y, vjp = jax.vjp(ours, x, kernel)
  y_ref, vjp_ref = jax.vjp(lambda x, k: _reference(x, k, strides, padding), x, kernel)
  np.testing.assert_allclose(y, y_ref, rtol=tol, atol=tol * float(jnp.max(jnp.abs(y_ref))))
  g = _rounded(rng.randn(*y.shape), dtype)
  for got, want in zip(vjp(g), vjp_ref(g)):
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(jnp.max(jnp.abs(want))))


def test_patches_are_windows_in_kernel_order():
  # Each output position's window, flattened (kh, kw, c) as an HWIO kernel's first axes.
  x = jnp.arange(2 * 5 * 5 * 3, dtype=jnp.float32).reshape(2, 5, 5, 3)
  cols = conv_as_dot.patches(x, (3, 3), (2, 2), 'SAME')
  assert cols.shape == (2, 3, 3, 27)
  padded = np.pad(np.asarray(x), ((0, 0), (1, 1), (1, 1), (0, 0)))
  np.testing.assert_array_equal(cols[1, 2, 1], padded[1, 4:7, 2:5].reshape(-1))


def test_bf16_patches_are_concatenated_in_bf16():
  # XLA:CPU concatenates bf16 arrays in float32 (twice the bytes, converted to and from);
  # concatenated as their 16-bit patterns, the patches stay bf16, with the same values.
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, 32)).astype(jnp.bfloat16)
  to_cols = jax.jit(lambda x: conv_as_dot.patches(x, (3, 3), (1, 1), 'SAME'))
  hlo = to_cols.lower(x).compile().as_text()
  concatenates = re.findall(r'= (\w+)\[[\d,]*\]\S* concatenate\(', hlo)
  assert concatenates and 'f32' not in concatenates, concatenates
  padded = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
  np.testing.assert_array_equal(
      to_cols(x).astype(jnp.float32),
      jnp.concatenate([padded[:, i:i + 8, j:j + 8] for i in range(3) for j in range(3)],
                      axis=-1).astype(jnp.float32))


@pytest.mark.parametrize('dtype,channels,expected', [('bfloat16', 32, True), ('bfloat16', 3, False),
                                                     ('float32', 32, False)])
def test_im2col_only_for_deep_bf16_convolutions_on_cpu(dtype, channels, expected):
  # 3x3 over 32 channels is a 288-deep dot; the 7x7 root over 3 channels (147) stays a
  # convolution, as does every float32 one (no faster as a dot on XLA:CPU), and every
  # convolution on a TPU or GPU.
  expected = expected and jax.default_backend() == 'cpu'
  x = jnp.zeros((1, 8, 8, channels))
  kernel = jnp.zeros((3, 3, channels, 8) if channels > 3 else (7, 7, 3, 8))
  assert conv_as_dot.im2col_pays(jnp.dtype(dtype), kernel, x) is expected
  conv = jax.make_jaxpr(lambda x, k: conv_as_dot.conv(x, k, (1, 1), 'SAME', jnp.dtype(dtype)))
  text = str(conv(x, kernel))
  assert ('conv_general_dilated' in text) is not expected
  assert ('dot_general' in text) is expected


def _saved_shapes(f, *args, capsys):
  jax.ad_checkpoint.print_saved_residuals(f, *args)
  return re.findall(r'(?:f32|bf16)\[([\d,]+)\]', capsys.readouterr().out)


_CPU_ONLY = pytest.mark.skipif(jax.default_backend() != 'cpu',
                               reason='im2col dots are for XLA:CPU only')


@_CPU_ONLY
def test_im2col_backward_keeps_the_input_not_the_patches(capsys):
  x = jnp.ones((2, 8, 8, 32), jnp.bfloat16)
  kernel = jnp.ones((3, 3, 32, 16))
  f = lambda x, k: jnp.sum(conv_as_dot.conv(x, k, (1, 1), 'SAME', jnp.bfloat16))
  shapes = _saved_shapes(f, x, kernel, capsys=capsys)
  assert '2,8,8,32' in shapes and '2,8,8,288' not in shapes, shapes


@_CPU_ONLY
def test_backward_patches_are_not_merged_with_the_forward_ones(monkeypatch):
  # Without the dependence on g, XLA merges the backward's patches with the forward's
  # (the same expression) and keeps those alive across the step: the plan grows (25 vs
  # 50 MB under the suite's flags).
  x = jnp.ones((4, 32, 32, 64), jnp.bfloat16)
  kernels = [jnp.full((3, 3, 64, 64), 0.01 * (i + 1)) for i in range(4)]

  def planned_temporaries():

    def stack(x, kernels):  # a new function each time: jit would reuse an old trace
      for k in kernels:
        x = jax.nn.relu(conv_as_dot.conv(x, k, (1, 1), 'SAME', jnp.bfloat16)).astype(jnp.bfloat16)
      return jnp.sum(x.astype(jnp.float32)**2)

    compiled = jax.jit(jax.grad(stack, argnums=1)).lower(x, kernels).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  shipped = planned_temporaries()
  # Only the patches' dependence on g (4-D) goes; the weight gradients' on each other stays.
  shipped_depending_on = precision.depending_on
  monkeypatch.setattr(
      precision, 'depending_on', lambda x, dependency: x
      if dependency.ndim == 4 else shipped_depending_on(x, dependency))
  assert shipped < 0.8 * planned_temporaries()


def test_patch_embedding_is_flax_conv_in_parameters_and_values():
  # Same parameter names, shapes and initial values as the nn.Conv it replaced (published
  # checkpoints load unchanged; a seed gives the same model), and the same outputs.
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 32, 32, 3))
  ours = vit.PatchEmbedding(24, 16)
  flax_conv = nn.Conv(24, (16, 16), strides=(16, 16), padding='VALID')
  p_ours = ours.init(jax.random.PRNGKey(1), x)
  p_flax = flax_conv.init(jax.random.PRNGKey(1), x)
  jax.tree.map(np.testing.assert_array_equal, p_ours, p_flax)
  p = jax.tree.map(lambda v: v + 0.1, p_flax)  # a non-zero bias
  np.testing.assert_allclose(ours.apply(p, x), flax_conv.apply(p, x), rtol=1e-5, atol=1e-5)
