"""The ResNet stems' max pooling (3x3 windows, stride 2): flax's nn.max_pool, and on the
CPU backend the same values with a backward XLA:CPU runs 5-8x faster.

nn.max_pool is a reduce-window, whose gradient XLA runs as a select-and-scatter: on a
2-core CPU host its forward and backward at the R50 stem's shape (8x112x112x64) took
86-92 ms, in float32 and in bf16 (benchmarks/README.md, fifty-second session). Here the
forward is the maximum of the window's strided slices and the backward sends each output's
gradient to the first maximum of its window in scan order (row by row), as the
select-and-scatter does, summed in float32 where windows overlap: 11-17 ms, and the
R50+ViT-B/16 b8 train step 1.01-1.02x faster at the median of its rounds (`before_after.py
--change max_pool_slices`). The pooled values are the same; the gradients are the same
up to the order of that sum (in bf16 XLA's sums in bf16, this sums in float32 and rounds
once). TPU and GPU keep nn.max_pool.
"""
import functools

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp


def max_pool(x, window, stride, padding):
  """nn.max_pool(x, (window, window), (stride, stride), padding) of an NHWC `x`;
  `padding` 'SAME' (-inf around the edges) or 'VALID'."""
  if jax.default_backend() != 'cpu':
    return nn.max_pool(x, (window, window), strides=(stride, stride), padding=padding)
  return _max_pool(x, window, stride, padding)


def _edges(size, window, stride, padding):
  """(outputs, padding before, padding after) along one spatial axis, as XLA pads."""
  if padding == 'VALID':
    return (size - window) // stride + 1, 0, 0
  outputs = -(-size // stride)
  total = max((outputs - 1) * stride + window - size, 0)
  return outputs, total // 2, total - total // 2


def _windows(x, window, stride, padding):
  """The window's strided slices of `x` padded with -inf, row by row, and the pads."""
  (oh, top, bottom), (ow, left, right) = (_edges(n, window, stride, padding) for n in x.shape[1:3])
  xp = jnp.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)), constant_values=-jnp.inf)
  n, _, _, c = xp.shape
  slices = [
      lax.slice(xp, (0, i, j, 0), (n, i + stride * (oh - 1) + 1, j + stride * (ow - 1) + 1, c),
                (1, stride, stride, 1)) for i in range(window) for j in range(window)
  ]
  return slices, xp.shape, (top, left)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _max_pool(x, window, stride, padding):
  # float32 inside: XLA:CPU runs bf16 comparisons and pads many times slower.
  slices, _, _ = _windows(x.astype(jnp.float32), window, stride, padding)
  return functools.reduce(jnp.maximum, slices).astype(x.dtype)


def _max_pool_fwd(x, window, stride, padding):
  y = _max_pool(x, window, stride, padding)
  return y, (x, y)


def _max_pool_bwd(window, stride, padding, residuals, g):
  x, y = residuals
  f32 = jnp.float32
  slices, padded_shape, (top, left) = _windows(x.astype(f32), window, stride, padding)
  y, g = y.astype(f32), g.astype(f32)
  taken = jnp.zeros(y.shape, bool)  # outputs whose maximum an earlier position holds
  dx = jnp.zeros(padded_shape, f32)
  for index, piece in enumerate(slices):
    i, j = divmod(index, window)
    first = (piece == y) & ~taken
    taken = taken | first
    # Back to the positions the slice was taken from: every stride-th row and column.
    rows = (i, padded_shape[1] - i - stride * (y.shape[1] - 1) - 1, stride - 1)
    cols = (j, padded_shape[2] - j - stride * (y.shape[2] - 1) - 1, stride - 1)
    dx = dx + lax.pad(jnp.where(first, g, 0), f32(0), ((0, 0, 0), rows, cols, (0, 0, 0)))
  h, w = x.shape[1:3]
  return (dx[:, top:top + h, left:left + w].astype(x.dtype),)


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)
