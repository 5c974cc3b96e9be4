"""The ResNet stems' max pooling (3x3 windows, stride 2): flax's nn.max_pool, and on the
CPU backend the same values with a backward XLA:CPU runs 5-8x faster.

nn.max_pool is a reduce-window, whose gradient XLA runs as a select-and-scatter: on a
2-core CPU host its forward and backward at the R50 stem's shape (8x112x112x64) took
86-92 ms, in float32 and in bf16 (benchmarks/README.md, fifty-second session). Here the
forward is the maximum of the window's strided slices and the backward sends each output's
gradient to the first maximum of its window in scan order (row by row), as the
select-and-scatter does, summed in float32 where windows overlap: 11-17 ms, and the
R50+ViT-B/16 b8 train step 1.01-1.02x faster at the median of its rounds (`before_after.py
--change max_pool_slices`). The backward sums those gradients per phase of the input
(row % stride, column % stride) at the output's size and interleaves the phases: its
backward alone 12.4 -> 3.6 ms (float32) and 13.7 -> 3.1 (bf16) against spreading each
window offset's gradients to the input's size, and the bf16 R50+ViT-B/16 b8 step ran a
median 1.02x faster (fifty-sixth session). The pooled values are the same; the gradients
are the same up to the order of that sum (in bf16 XLA's sums in bf16, this sums in float32
and rounds once). TPU and GPU keep nn.max_pool.
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
  n, oh, ow, c = y.shape
  # The padded gradient by phase (row % stride, column % stride): output (o, q) of window
  # offset (i, j) lands at padded position (stride*o + i, stride*q + j), i.e. in phase
  # (i % stride, j % stride) at (o + i // stride, q + j // stride). Each phase sums only its
  # own offsets' contributions at the output's size, then the phases are interleaved: at
  # stride 2 a quarter of the work of adding every offset's contribution spread to the
  # input's size.
  rows, cols = -(-padded_shape[1] // stride), -(-padded_shape[2] // stride)
  phases = {}
  taken = jnp.zeros(y.shape, bool)  # outputs whose maximum an earlier position holds
  for index, piece in enumerate(slices):
    (si, ri), (sj, rj) = (divmod(k, stride) for k in divmod(index, window))
    first = (piece == y) & ~taken
    taken = taken | first
    moved = jnp.pad(jnp.where(first, g, 0),
                    ((0, 0), (si, rows - oh - si), (sj, cols - ow - sj), (0, 0)))
    phases[ri, rj] = phases[ri, rj] + moved if (ri, rj) in phases else moved
  none = jnp.zeros((n, rows, cols, c), f32)  # a phase no offset reaches (window < stride)
  interleaved = jnp.stack(
      [jnp.stack([phases.get((a, b), none) for b in range(stride)], axis=3) for a in range(stride)],
      axis=2).reshape(n, rows * stride, cols * stride, c)
  h, w = x.shape[1:3]
  return (interleaved[:, top:top + h, left:left + w].astype(x.dtype),)


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)
