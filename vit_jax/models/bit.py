"""BiT ResNet v2 (Kolesnikov et al., 2020): pre-activation, GroupNorm, standardised convs.

As in the published BiT-S/BiT-M files: root = 7x7/2 conv with symmetric padding 3, zero
padding 1, VALID 3x3/2 max-pool (no norm in the root: the units are pre-activation);
unit = GN -> ReLU feeding both the projection (first unit of a stage) and a 1x1 conv,
then GN -> ReLU -> 3x3 (stride, padding 1) and GN -> ReLU -> 1x1; head = GN -> ReLU ->
global average pool -> Dense. Parameter names here are flax-style (conv_root,
block1/unit01/gn1, conv_proj, norm, head); checkpoint.py maps the files' TF names.
"""
from typing import Any, Sequence

import flax.linen as nn
import jax.numpy as jnp

from vit_jax.models import activations
from vit_jax.models import inputs
from vit_jax.models import normalization
from vit_jax.models import pooling
from vit_jax.models import precision
from vit_jax.models.resnet import Stage
from vit_jax.models.resnet import StdConv

# BiT's GroupNorm epsilon (PyTorch/TF default) and weight-standardisation epsilon.
_GN_EPS = 1e-5
_WS_EPS = 1e-10


class PreActUnit(nn.Module):
  """Pre-activation bottleneck with `features` mid channels and 4x output channels."""
  features: int
  strides: Sequence[int] = (1, 1)
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):

    def conv(f, k, s, name):
      pad = [(k // 2, k // 2)] * 2  # symmetric, as the published BiT models
      return StdConv(f, (k, k), s, pad, eps=_WS_EPS, eps_in_sqrt=True, dtype=self.dtype, name=name)

    def gn_relu(y, name):
      return activations.relu(
          normalization.GroupNorm(epsilon=_GN_EPS, dtype=self.dtype, name=name)(y))

    out = gn_relu(x, 'gn1')
    residual = x
    if x.shape[-1] != self.features * 4 or tuple(self.strides) != (1, 1):
      residual = conv(self.features * 4, 1, self.strides, 'conv_proj')(out)
    y = conv(self.features, 1, (1, 1), 'conv1')(out)
    y = conv(self.features, 3, self.strides, 'conv2')(gn_relu(y, 'gn2'))
    y = conv(self.features * 4, 1, (1, 1), 'conv3')(gn_relu(y, 'gn3'))
    return y + residual


class BiTResNet(nn.Module):
  """BiT ResNet v2 classifier; `num_classes=0` returns the pooled features."""
  num_classes: int
  resnet_layers: Sequence[int]
  resnet_width: int = 1
  head_bias_init: float = 0.0
  dtype: Any = jnp.float32
  remat: Any = ''  # a remat.py policy name ('' off) or the old True/False

  @nn.compact
  def __call__(self, images, *, train=False):
    del train  # no dropout or batch statistics in BiT
    inputs.check_images(images)
    width = 64 * self.resnet_width
    x = images.astype(self.dtype)
    x = StdConv(width, (7, 7), (2, 2), [(3, 3), (3, 3)], eps=_WS_EPS, eps_in_sqrt=True,
                dtype=self.dtype, name='conv_root')(x)
    x = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))  # zeros, not -inf: as published
    x = pooling.max_pool(x, 3, 2, 'VALID')
    for i, num_units in enumerate(self.resnet_layers):
      x = Stage(PreActUnit, num_units, width * 2**i, (2, 2) if i else (1, 1), 'unit{:02d}',
                self.dtype, self.remat, name=f'block{i + 1}')(x)
    x = activations.relu(normalization.GroupNorm(epsilon=_GN_EPS, dtype=self.dtype, name='norm')(x))
    x = jnp.mean(x, axis=(1, 2))
    self.sow('intermediates', 'representation', x)  # the few-shot features
    if not self.num_classes:
      return x
    x = nn.Dense(self.num_classes, dtype=self.dtype, kernel_init=nn.initializers.zeros,
                 bias_init=nn.initializers.constant(self.head_bias_init), name='head',
                 **precision.dense_options(self.dtype))(x)
    return x.astype(jnp.float32)
