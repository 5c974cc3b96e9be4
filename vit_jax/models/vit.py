"""Vision Transformer (Dosovitskiy et al., 2020), optionally on a ResNet stem (hybrid).

Submodule names are those of the published .npz files, so a checkpoint's flat keys
joined by '/' are this module's parameter paths:
  embedding, cls, Transformer/posembed_input/pos_embedding,
  Transformer/encoderblock_{i}/{LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2,
  MlpBlock_3/Dense_{0,1}}, Transformer/encoder_norm, pre_logits, head.
Inputs are float NHWC in [-1, 1]; the model does no normalisation of its own.
"""
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp

from vit_jax.models import activations
from vit_jax.models import attention
from vit_jax.models import conv_as_dot
from vit_jax.models import inputs
from vit_jax.models import precision
from vit_jax.models import remat as remat_lib
from vit_jax.models import resnet


class AddPositionEmbs(nn.Module):
  """Learned 1D position embeddings, normal(0.02) as in BERT."""

  @nn.compact
  def __call__(self, x):
    pe = self.param('pos_embedding', nn.initializers.normal(stddev=0.02),
                    (1, x.shape[1], x.shape[2]), jnp.float32)
    return x + pe.astype(x.dtype)


class PatchEmbedding(nn.Module):
  """The linear projection of flattened p x p patches (Eq. 1), parameters as a flax Conv's
  (kernel [p, p, C, D], bias [D]; the same initialisers), computed as a dot (conv_as_dot.py)."""
  features: int
  patch_size: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    p = self.patch_size
    kernel = self.param('kernel', nn.initializers.lecun_normal(),
                        (p, p, x.shape[-1], self.features), jnp.float32)
    bias = self.param('bias', nn.initializers.zeros, (self.features,), jnp.float32)
    # Where precision.is_mixed the bias is added to the dot's float32 result, as in the
    # dense layers.
    return (conv_as_dot.conv(x, kernel, (p, p), 'VALID', self.dtype) + bias).astype(self.dtype)


class MlpBlock(nn.Module):
  """Dense -> GELU (tanh approximation) -> dropout -> Dense -> dropout. `recompute_gelu`
  (remat 'gelu'): without dropout, the second layer applies the GELU inside its dot and
  computes it again in the backward pass."""
  mlp_dim: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  recompute_gelu: bool = False

  @nn.compact
  def __call__(self, x, *, deterministic):
    dense = lambda f, name, activation=None: nn.Dense(
        f, dtype=self.dtype, kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers
        .normal(stddev=1e-6), name=name, **precision.dense_options(self.dtype, activation))
    out = lambda y: precision.layer_output(y, self.dtype)
    y = out(dense(self.mlp_dim, 'Dense_0')(x))
    if self.recompute_gelu and (deterministic or self.dropout_rate == 0.0):
      y = out(dense(x.shape[-1], 'Dense_1', activations.gelu)(y))
    else:
      y = nn.Dropout(self.dropout_rate)(activations.gelu(y), deterministic=deterministic)
      y = out(dense(x.shape[-1], 'Dense_1')(y))
    return nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)


def _writes_weights(module, attention_dropout_rate, deterministic):
  """Whether `module`'s attention writes its weights out: to sow them for inspection or to
  drop some out."""
  sows = module.is_mutable_collection('intermediates')
  return sows or (attention_dropout_rate > 0.0 and not deterministic)


def attention_fuses(module, dtype, head_dim, attention_dropout_rate, deterministic):
  """Whether `module`'s attention runs cuDNN's fused core (attention.fuses), which does not
  write the weights."""
  return (not _writes_weights(module, attention_dropout_rate, deterministic)
          and attention.fuses(dtype, head_dim))


def pads_tokens_once(fused, tokens):
  """Whether the encoder pads its odd token count to an even one once, for all its blocks'
  fused attention, instead of each attention padding q, k and v and slicing its output
  (attention.attend_fused). The padded token is masked out as a key, so the others' outputs
  and every gradient are those without it. On an H200 the bf16 ViT-B/16 b128 step ran
  1.003-1.014x as fast and planned 10% less memory (benchmarks/README.md, forty-ninth
  session)."""
  return fused and tokens % 2 == 1


class MultiHeadDotProductAttention(nn.Module):
  """Self-attention with the published parameter layout.

  query/key/value kernels are (D, heads, head_dim), out is (heads, head_dim, D).
  Logits are scaled by 1/sqrt(head_dim) and the softmax is taken in float32. In a
  bfloat16 model every dot has bf16 operands and float32 accumulation (precision.py).
  The attention weights are sown into 'intermediates' for inspection (free otherwise).
  `key_tokens`: the encoder padded the tokens; only the first key_tokens are keys.
  """
  num_heads: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  key_tokens: Optional[int] = None

  @nn.compact
  def __call__(self, x, *, deterministic):
    d = x.shape[-1]
    if d % self.num_heads:
      raise ValueError(f'hidden_size {d} is not divisible by num_heads {self.num_heads}')
    head_dim = d // self.num_heads
    options = precision.dense_options(self.dtype)
    proj = lambda name: nn.DenseGeneral((self.num_heads, head_dim), dtype=self.dtype, kernel_init=nn
                                        .initializers.xavier_uniform(), name=name, **options)
    out = lambda y: precision.layer_output(y, self.dtype)
    q, k, v = (out(proj(name)(x)) for name in ('query', 'key', 'value'))
    q = q / jnp.sqrt(head_dim).astype(q.dtype)
    fused = attention_fuses(self, self.dtype, head_dim, self.dropout_rate, deterministic)
    if self.key_tokens is not None and not fused:
      raise ValueError('padded tokens (key_tokens) need the fused attention, which masks them')
    if _writes_weights(self, self.dropout_rate, deterministic):
      weights = attention.weights(q, k, self.dtype)
      self.sow('intermediates', 'attention_weights', weights)
      if self.dropout_rate > 0.0:
        weights = nn.Dropout(self.dropout_rate, broadcast_dims=())(weights,
                                                                   deterministic=deterministic)
      y = attention.values(weights, v, self.dtype)
      heads_axes = (1, 3)
    elif fused:  # bf16 on a GPU: cuDNN's, (b, q, h, d)
      y = attention.attend_fused(q, k, v, self.key_tokens)
      heads_axes = (2, 3)
    else:  # no weights to sow or drop: in bf16 on CPU they are not kept (attention.py)
      y = attention.attend(q, k, v, self.dtype)
      heads_axes = (1, 3)
    # y stays heads-major (b, h, q, d) where a batched dot leaves it so, and `out` contracts
    # (h, d) where they are: no transpose back to (b, q, h, d) in either direction. On
    # XLA:CPU the attention alone ran 1-10% faster, the ViT-Ti f32 step 4-5%
    # (benchmarks/README.md, tenth session). The kernel is (h, d, D) either way.
    return out(
        nn.DenseGeneral(d, axis=heads_axes, dtype=self.dtype,
                        kernel_init=nn.initializers.xavier_uniform(), name='out',
                        **options)(y.astype(self.dtype)))


class EncoderBlock(nn.Module):
  """Pre-LN Transformer block: x + MSA(LN(x)), then x + MLP(LN(x))."""
  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  key_tokens: Optional[int] = None  # see MultiHeadDotProductAttention
  recompute_gelu: bool = False  # see MlpBlock

  @nn.compact
  def __call__(self, x, deterministic):
    y = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, name='LayerNorm_0')(x)
    y = MultiHeadDotProductAttention(self.num_heads, self.attention_dropout_rate, self.dtype,
                                     self.key_tokens, name='MultiHeadDotProductAttention_1')(
                                         y, deterministic=deterministic)
    x = x + nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    y = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, name='LayerNorm_2')(x)
    y = MlpBlock(self.mlp_dim, self.dropout_rate, self.dtype, self.recompute_gelu,
                 name='MlpBlock_3')(y, deterministic=deterministic)
    return x + y


class Encoder(nn.Module):
  """Position embeddings, `num_layers` blocks, final LayerNorm."""
  num_layers: int
  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  remat: Any = ''  # a remat.py policy name ('' off) or the old True/False

  @nn.compact
  def __call__(self, x, *, train):
    x = AddPositionEmbs(name='posembed_input')(x)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
    tokens = x.shape[1]
    fused = attention_fuses(self, self.dtype, x.shape[-1] // self.num_heads,
                            self.attention_dropout_rate, not train)
    key_tokens = tokens if pads_tokens_once(fused, tokens) else None
    if key_tokens:
      x = jnp.pad(x, ((0, 0), (0, 1), (0, 0)))
    # `deterministic` is positional so remat can treat it as static.
    block_cls = remat_lib.wrap(EncoderBlock, self.remat, self.dtype, static_argnums=(2,))
    for i in range(self.num_layers):
      x = block_cls(self.mlp_dim, self.num_heads, self.dropout_rate,
                    self.attention_dropout_rate, self.dtype, key_tokens,
                    remat_lib.recomputes_gelu(self.remat), name=f'encoderblock_{i}')(x, not train)
    return nn.LayerNorm(epsilon=1e-6, dtype=self.dtype, name='encoder_norm')(x[:, :tokens])


class VisionTransformer(nn.Module):
  """ViT or hybrid classifier; `num_classes=0` returns the pre-logit features."""
  num_classes: int
  patch_size: int
  hidden_size: int
  mlp_dim: int
  num_heads: int
  num_layers: int
  classifier: str = 'token'
  representation_size: Optional[int] = None
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  resnet_layers: Optional[Sequence[int]] = None
  resnet_width: float = 1
  head_bias_init: float = 0.0
  dtype: Any = jnp.float32
  remat: Any = ''  # see Encoder

  @nn.compact
  def __call__(self, images, *, train=False, corrupt=None, patch_outputs=0):
    """Logits, features (num_classes=0), or with `corrupt` per-patch predictions.

    corrupt: optional (kind, source), int [n, N] each, for masked patch prediction
      (Sec. 4.6, vit_jax/masked_patches.py): before the position embeddings, patch i
      becomes a learned `mask_embedding` where kind == 1, patch source[i] of the same
      image where kind == 2, and stays itself elsewhere. The call then returns the
      `masked_patch_head` outputs [n, N, patch_outputs] of every patch token. Both
      parameters exist only in models called this way; they are dropped on fine-tuning.
    """
    inputs.check_images(images)
    x = images.astype(self.dtype)
    if self.resnet_layers is not None:
      x = resnet.resnet_stem(x, self.resnet_layers, self.resnet_width, self.dtype, self.remat)
    h, w = x.shape[1:3]
    if h % self.patch_size or w % self.patch_size:
      raise ValueError(f'Feature map {h}x{w} is not divisible by patch size {self.patch_size}: '
                       f'use an image size divisible by {images.shape[1] // h * self.patch_size}')
    p = self.patch_size
    x = PatchEmbedding(self.hidden_size, p, self.dtype, name='embedding')(x)
    n, h, w, c = x.shape
    x = jnp.reshape(x, (n, h * w, c))
    if corrupt is not None:
      kind, source = corrupt
      mask = self.param('mask_embedding', nn.initializers.normal(stddev=0.02), (1, 1, c),
                        jnp.float32)
      other = jnp.take_along_axis(x, source[..., None].astype(jnp.int32), axis=1)
      x = jnp.where((kind == 2)[..., None], other, x)
      x = jnp.where((kind == 1)[..., None], mask.astype(x.dtype), x)
    if self.classifier == 'token':
      cls = self.param('cls', nn.initializers.zeros, (1, 1, c), jnp.float32)
      x = jnp.concatenate([jnp.broadcast_to(cls.astype(x.dtype), (n, 1, c)), x], axis=1)
    x = Encoder(self.num_layers, self.mlp_dim, self.num_heads, self.dropout_rate,
                self.attention_dropout_rate, self.dtype, self.remat,
                name='Transformer')(x, train=train)
    if corrupt is not None:
      x = x[:, 1:] if self.classifier == 'token' else x
      return nn.Dense(patch_outputs, dtype=self.dtype,
                      kernel_init=nn.initializers.zeros, name='masked_patch_head',
                      **precision.dense_options(self.dtype))(x).astype(jnp.float32)
    x = x[:, 0] if self.classifier == 'token' else jnp.mean(x, axis=1)
    if self.representation_size is not None:
      x = jnp.tanh(
          nn.Dense(self.representation_size, dtype=self.dtype, name='pre_logits',
                   **precision.dense_options(self.dtype))(x).astype(self.dtype))
    # The few-shot features; not named 'pre_logits', the Dense layer's own scope above.
    self.sow('intermediates', 'representation', x)
    if not self.num_classes:
      return x
    x = nn.Dense(self.num_classes, dtype=self.dtype, kernel_init=nn.initializers.zeros,
                 bias_init=nn.initializers.constant(self.head_bias_init), name='head',
                 **precision.dense_options(self.dtype))(x)
    return x.astype(jnp.float32)
