"""flax's GroupNorm with the statistics taken per channel first, and, for an input narrower
than float32, a backward that keeps only that input and each group's mean and inverse
standard deviation.

The statistics are flax's (E[x] and E[x^2] - E[x]^2 in float32, clipped at 0), summed in
another order: each channel's sums over the positions, then over the group's channels.
flax reduces the positions and the group's channels in one reduction, keeping the group
axis between reduced ones, which XLA:CPU ran 5-10x slower than per-channel sums (the R50
root's 8x112x112x64: 20 ms against 2.6, float32 or bf16); the normalised values differ
from flax's by rounding only. For a float32 input the statistics are broadcast to each
channel before the positions, so that autodiff's sums for them are per channel too. The
GroupNorm alone, forward and backward, ran 1.6-2.0x faster at the R50 stem's shapes; the
train step 1.03-1.06x for BiT-M-R50x1 b8 and 1.00-1.04x for R50+ViT-B/16 b8 in either
dtype, planning the same memory (BiT bf16 +0.9%) (benchmarks/README.md, fifty-fourth
session; `benchmarks/before_after.py --change group_norm_channel_sums`); not measured on
TPU or GPU.

flax's autodiff keeps float32 arrays of the input's size (x - mean) for the backward, beside
a bf16 input. For an input narrower than float32 the backward here recomputes the
normalised input from the input as it came and the statistics, and takes the closed form of
the gradient in float32, summing over the positions first so that the full-size arrays are
read once for all its sums. With activations.relu (whose backward keeps its output, the
next convolution's input) the bf16 train step on a 2-core host plans 8% less memory for
R50+ViT-B/16 b8 at 1.00-1.05x the speed, and 31% less for BiT-M-R50x1 b8 at 1.11-1.16x
(benchmarks/README.md, fifty-third session; `benchmarks/before_after.py --change
lean_group_norm`); not measured on TPU or GPU. A float32 input gets autodiff's backward
(there autodiff keeps nothing wider than the input).
"""
import functools
import math

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp

_F32 = jnp.float32


def _statistics(x, groups):
  """Each group's mean and variance, (example, group) in float32 (flax's: E[x^2] - E[x]^2,
  clipped at 0), of x viewed as (example, position, channel): each channel's sums over the
  positions, then over the group's channels."""
  n, positions, channels = x.shape
  x = x.astype(_F32)
  group_sums = lambda sums: jnp.sum(sums.reshape(n, groups, -1), -1)
  count = positions * (channels // groups)
  mean = group_sums(jnp.sum(x, 1)) / count
  var = jnp.maximum(0.0, group_sums(jnp.sum(lax.square(x), 1)) / count - lax.square(mean))
  return mean, var


def _normalize(x, scale, bias, groups, epsilon, dtype):
  """(x - mean) * rsqrt(var + epsilon) * scale + bias in `dtype` of x viewed as (example,
  position, channel), for autodiff: each group's statistics are broadcast to its channels
  first, so that autodiff's sums for them are per channel too."""
  n, _, channels = x.shape
  mean, var = _statistics(x, groups)
  per_channel = lambda v: jnp.broadcast_to(v[..., None],
                                           (n, groups, channels // groups)).reshape(n, 1, channels)
  # flax's order of operations: (x - mean) * (inv_std * scale) + bias.
  y = (x - per_channel(mean)) * (per_channel(lax.rsqrt(var + epsilon)) * scale) + bias
  return y.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _normalize_keeping_input(x, scale, bias, epsilon, dtype):
  """_normalize's values, of a grouped view x (example, *positions, group, channel in
  group) with `scale` and `bias` (group, channel in group), whose backward keeps x and the
  group statistics. (This view, the statistics broadcast to a group at once, planned less
  memory for the bf16 backward than _normalize's: the hybrids' stem 10.9 vs 12.7 MB with
  YNNPACK's fusions off, the same with them.)"""
  return _forward(x, scale, bias, epsilon, dtype)[0]


def _forward(x, scale, bias, epsilon, dtype):
  n, groups, size = x.shape[0], x.shape[-2], x.shape[-1]
  mean, var = _statistics(x.reshape(n, -1, groups * size), groups)
  # (example, 1, ..., 1, group, 1), as x's axes.
  as_grouped = lambda v: v.reshape(n, *(1,) * (x.ndim - 3), groups, 1)
  mean, inv_std = as_grouped(mean), as_grouped(lax.rsqrt(var + epsilon))
  y = (x - mean) * (inv_std * scale) + bias
  return y.astype(dtype), (x, scale, mean, inv_std)


def _backward(epsilon, dtype, residuals, g):
  del epsilon, dtype
  x, scale, mean, inv_std = residuals
  positions = tuple(range(1, x.ndim - 2))
  g = g.astype(_F32)
  x_hat = (x.astype(_F32) - mean) * inv_std
  g_sum = jnp.sum(g, positions, keepdims=True)
  g_x_hat_sum = jnp.sum(g * x_hat, positions, keepdims=True)
  examples_and_positions = tuple(range(x.ndim - 2))
  d_bias = jnp.sum(g_sum, examples_and_positions)
  d_scale = jnp.sum(g_x_hat_sum, examples_and_positions)
  # The group means of d_x_hat = g * scale and of d_x_hat * x_hat.
  count = math.prod(x.shape[1:-2]) * x.shape[-1]
  d_x_hat_mean = jnp.sum(g_sum * scale, -1, keepdims=True) / count
  d_x_hat_x_hat_mean = jnp.sum(g_x_hat_sum * scale, -1, keepdims=True) / count
  d_x = inv_std * (g * scale - d_x_hat_mean - x_hat * d_x_hat_x_hat_mean)
  return d_x.astype(x.dtype), d_scale.astype(scale.dtype), d_bias.astype(scale.dtype)


_normalize_keeping_input.defvjp(_forward, _backward)


class GroupNorm(nn.GroupNorm):
  """flax.linen.GroupNorm; for a float32 or narrower input with flax's default options
  (`num_groups`, statistics over the positions, a scale and a bias), _normalize with
  autodiff's backward for float32 and _normalize_keeping_input for narrower inputs. (For a
  float32 input that backward planned more memory than autodiff's: R50+ViT-B/16 b8 2.80 vs
  2.50 GiB.)"""

  @nn.compact
  def __call__(self, x, *, mask=None):
    channels = x.shape[-1]
    # flax's own for everything else (and its errors for groups that do not divide).
    if (x.ndim < 2 or not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).bits > 32
        or mask is not None or self.group_size is not None or self.reduction_axes is not None
        or not (self.use_bias and self.use_scale) or not self.use_fast_variance
        or not self.force_float32_reductions or self.axis_name or not self.num_groups
        or channels % self.num_groups):
      return super().__call__(x, mask=mask)
    scale = self.param('scale', self.scale_init, (channels,), self.param_dtype)
    bias = self.param('bias', self.bias_init, (channels,), self.param_dtype)
    dtype = jnp.dtype(self.dtype or jnp.result_type(x, scale, bias))
    groups = self.num_groups
    if jnp.finfo(x.dtype).bits >= 32:
      view = x.reshape(x.shape[0], -1, channels)
      return _normalize(view, scale, bias, groups, self.epsilon, dtype).reshape(x.shape)
    group_shape = (groups, channels // groups)
    y = _normalize_keeping_input(x.reshape(*x.shape[:-1], *group_shape), scale.reshape(group_shape),
                                 bias.reshape(group_shape), self.epsilon, dtype)
    return y.reshape(x.shape)
