"""ResNet with GroupNorm and weight-standardised convolutions, as the hybrid stems use.

Post-activation bottlenecks (conv -> GN -> ReLU), GN on conv3 before the residual add,
ReLU after it; stride on the 3x3 conv; projection only in the first unit of a stage;
TF "SAME" padding. Parameter names follow the published R50+ViT files (conv_root,
gn_root, block1/unit1/conv1, ...). StdConv is shared with the BiT models.
"""
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.models import activations
from vit_jax.models import conv_as_dot
from vit_jax.models import normalization
from vit_jax.models import pooling
from vit_jax.models import precision
from vit_jax.models import remat as remat_lib


class StdConv(nn.Module):
  """Bias-free convolution whose kernel is standardised per output channel.

  The two published families standardise slightly differently, so both are exact:
  hybrids (w - mean) / (std + eps) with eps 1e-5; BiT (w - mean) / sqrt(var + eps)
  with eps 1e-10 (`eps_in_sqrt=True`).
  """
  features: int
  kernel_size: Sequence[int]
  strides: Sequence[int] = (1, 1)
  padding: Any = 'SAME'
  eps: float = 1e-5
  eps_in_sqrt: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    shape = (*self.kernel_size, x.shape[-1], self.features)
    w = self.param('kernel', nn.initializers.lecun_normal(), shape, jnp.float32)
    w = w - jnp.mean(w, axis=(0, 1, 2), keepdims=True)
    var = jnp.mean(jnp.square(w), axis=(0, 1, 2), keepdims=True)
    w = w * (jax.lax.rsqrt(var + self.eps) if self.eps_in_sqrt else 1.0 /
             (jnp.sqrt(var) + self.eps))
    return precision.layer_output(conv_as_dot.conv(x, w, self.strides, self.padding, self.dtype),
                                  self.dtype)


class ResidualUnit(nn.Module):
  """Post-activation bottleneck: 1x1 -> 3x3 (stride) -> 1x1 (4x features)."""
  features: int
  strides: Sequence[int] = (1, 1)
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    conv = lambda f, k, s, name: StdConv(f, k, s, dtype=self.dtype, name=name)
    gn = lambda name, **kw: normalization.GroupNorm(dtype=self.dtype, name=name, **kw)
    residual = x
    if x.shape[-1] != self.features * 4 or tuple(self.strides) != (1, 1):
      residual = conv(self.features * 4, (1, 1), self.strides, 'conv_proj')(x)
      residual = gn('gn_proj')(residual)
    y = activations.relu(gn('gn1')(conv(self.features, (1, 1), (1, 1), 'conv1')(x)))
    y = activations.relu(gn('gn2')(conv(self.features, (3, 3), self.strides, 'conv2')(y)))
    y = conv(self.features * 4, (1, 1), (1, 1), 'conv3')(y)
    # Zero-initialised last GN scale: every unit starts as the identity on its residual.
    y = gn('gn3', scale_init=nn.initializers.zeros)(y)
    return activations.relu(residual + y)


class Stage(nn.Module):
  """`num_units` units of `unit_cls`; the first strides (and projects).

  Units are named by `unit_name`: unit1, unit2, ... in the hybrid files, unit01, ... in BiT's.
  """
  unit_cls: Any
  num_units: int
  features: int
  first_stride: Sequence[int]
  unit_name: str = 'unit{}'
  dtype: Any = jnp.float32
  remat: Any = ''  # a remat.py policy name ('' off) or the old True/False

  @nn.compact
  def __call__(self, x):
    unit_cls = remat_lib.wrap(self.unit_cls, self.remat, self.dtype)
    for j in range(self.num_units):
      strides = self.first_stride if j == 0 else (1, 1)
      x = unit_cls(self.features, strides, dtype=self.dtype, name=self.unit_name.format(j + 1))(x)
    return x


def resnet_stem(x, layers, width_factor, dtype=jnp.float32, remat=''):
  """Root block and stages of a hybrid; call inside a compact method.

  The modules become children of the calling module, so their names sit at the top of
  the parameter tree as in the published files (conv_root, gn_root, block1, ...).
  """
  width = int(64 * width_factor)
  x = StdConv(width, (7, 7), (2, 2), dtype=dtype, name='conv_root')(x)
  x = activations.relu(normalization.GroupNorm(dtype=dtype, name='gn_root')(x))
  x = pooling.max_pool(x, 3, 2, 'SAME')
  for i, num_units in enumerate(layers):
    x = Stage(ResidualUnit, num_units, width * 2**i, (2, 2) if i else (1, 1), dtype=dtype,
              remat=remat, name=f'block{i + 1}')(x)
  return x
