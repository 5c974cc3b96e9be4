"""The models' convolutions, written as matmuls where the matmul is the faster kernel.

A convolution is a dot of its input's windows with the kernel flattened to (kh*kw*c, out).
- 1x1 kernels (the ResNets' bottleneck convolutions, the hybrids' patch embedding) and
  non-overlapping windows (ViT's patch embedding: stride = kernel, VALID) are always dots,
  of the input itself, reshaped. The paper describes the patch embedding so ("a trainable
  linear projection" of flattened patches, Eq. 1); on XLA:CPU the dot's kernel gradient is
  one matmul where the convolution's wrote transposed copies (standalone fwd+bwd: ViT-B/16
  b8 bf16 embedding 24 -> 11 ms, the R50 hybrid's 1x1 67 -> 38 ms in f32, 69 -> 23 in bf16).
- Overlapping kxk windows (the ResNets' 3x3 convolutions) are dots of their im2col patches
  only on the CPU backend in bfloat16 (`im2col_pays`): XLA:CPU runs a bf16 convolution at
  its float32 rate, while a bf16 x bf16 -> f32 dot runs at about twice that (precision.py).
  Standalone, the R50 stem's 3x3 convolutions ran fwd+bwd 1.4-2.1x faster so; in float32
  some ran slower. Elsewhere they stay XLA convolutions.
- The backward of a dot of patches keeps the input, not its patches (9x its size for 3x3),
  and builds them again.
The products are the convolution's; their float32 sums run in another order.
(benchmarks/before_after.py --change conv_as_dot times the step both ways.)
"""
import functools

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from vit_jax.models import precision

# A dot shallower than this (the 7x7 root convolution of 3 channels: 147) measured no
# faster than the convolution.
_MIN_IM2COL_DEPTH = 256


def _pads(size, window, stride, padding):
  """(low, high) zero padding of one spatial axis: 'SAME' as TF (extra at the end), 'VALID'
  none, or a given (low, high) pair."""
  if padding == 'VALID':
    return 0, 0
  if padding == 'SAME':
    total = max((-(-size // stride) - 1) * stride + window - size, 0)
    return total // 2, total - total // 2
  return tuple(padding)


def _explicit(x, kernel_size, strides, padding):
  per_axis = [padding] * 2 if isinstance(padding, str) else padding
  return [_pads(x.shape[1 + i], kernel_size[i], strides[i], per_axis[i]) for i in range(2)]


def patches(x, kernel_size, strides, padding):
  """[n, oh, ow, kh*kw*c]: each output position's input window, flattened in the order of
  an HWIO kernel's first three axes."""
  (kh, kw), (sh, sw) = kernel_size, strides
  pads = _explicit(x, kernel_size, strides, padding)
  if (kh, kw) == (sh, sw) and not any(sum(p) for p in pads):  # non-overlapping: a reshape
    n, h, w, c = x.shape
    x = x[:, :h - h % kh, :w - w % kw]
    x = x.reshape(n, h // kh, kh, w // kw, kw, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(n, h // kh, w // kw, kh * kw * c)
  x = jnp.pad(x, ((0, 0), *pads, (0, 0)))
  oh = (x.shape[1] - kh) // sh + 1
  ow = (x.shape[2] - kw) // sw + 1
  return concatenate_channels([
      x[:, i:i + (oh - 1) * sh + 1:sh, j:j + (ow - 1) * sw + 1:sw] for i in range(kh)
      for j in range(kw)
  ])


def concatenate_channels(pieces):
  """jnp.concatenate(pieces, axis=-1); bfloat16 pieces as their 16-bit patterns, which
  XLA:CPU would otherwise concatenate in float32 (twice the bytes, and conversions to and
  from it: the bf16 R50+ViT-B/16 step ran 1.04-1.06x faster so, benchmarks/README.md)."""
  if pieces[0].dtype != jnp.bfloat16:
    return jnp.concatenate(pieces, axis=-1)
  bits = [lax.bitcast_convert_type(p, jnp.uint16) for p in pieces]
  return lax.bitcast_convert_type(jnp.concatenate(bits, axis=-1), jnp.bfloat16)


def im2col_pays(dtype, kernel, x):
  """Whether `conv` computes a convolution of overlapping windows as a dot of patches."""
  depth = kernel.shape[0] * kernel.shape[1] * x.shape[-1]
  return (jax.default_backend() == 'cpu' and precision.is_mixed(dtype)
          and depth >= _MIN_IM2COL_DEPTH)


_FLAT = (((3,), (0,)), ((), ()))  # [n, oh, ow, K] . [K, out]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _patches_dot(x, kernel, strides, padding, compute_dtype):
  """The convolution as precision.py's dot of x's patches: `compute_dtype` operands, a
  float32 result."""
  cols = patches(x.astype(compute_dtype), kernel.shape[:2], strides, padding)
  return lax.dot_general(cols,
                         kernel.reshape(-1, kernel.shape[-1]).astype(compute_dtype), _FLAT,
                         preferred_element_type=jnp.float32)


def _patches_dot_fwd(x, kernel, strides, padding, compute_dtype):
  return _patches_dot(x, kernel, strides, padding, compute_dtype), (x, kernel)


def _patches_dot_bwd(strides, padding, compute_dtype, residuals, g):
  # The backward keeps x, not its patches (9x its size for a 3x3 kernel; for a patch
  # embedding, a copy of the images), and builds them again.
  x, kernel = residuals
  # Patches built after g are not merged with the forward pass's own (the same
  # expression), which XLA would then keep alive until the backward pass (+0.1 GiB
  # planned, R50+ViT-B/16 b8).
  x = precision.depending_on(x, g)
  to_cols = functools.partial(patches, kernel_size=kernel.shape[:2], strides=strides,
                              padding=padding)
  d_cols, d_kernel = precision.dot_gradients(g, to_cols(x.astype(compute_dtype)),
                                             kernel.reshape(-1, kernel.shape[-1]), _FLAT,
                                             compute_dtype, lhs_grad_dtype=jnp.float32)
  # The patches' transpose adds each input pixel's gradients (up to kh*kw), in float32.
  (d_x,) = jax.linear_transpose(to_cols, jax.ShapeDtypeStruct(x.shape, jnp.float32))(d_cols)
  return d_x.astype(x.dtype), d_kernel.reshape(kernel.shape)


_patches_dot.defvjp(_patches_dot_fwd, _patches_dot_bwd)


def conv(x, kernel, strides, padding, dtype):
  """conv_general_dilated(x, kernel) in NHWC/HWIO for a model computing in `dtype`: a dot
  where the module doc says. The result is in `dtype`, or float32 where it is a dot of
  precision.py's (the caller casts, after adding any bias)."""
  kernel_size, strides = tuple(kernel.shape[:2]), tuple(strides)
  pads = tuple(map(tuple, _explicit(x, kernel_size, strides, padding)))
  dot = precision.dot_general_for(dtype)
  if kernel_size == (1, 1):
    # No padding for a 1x1 window (SAME or VALID); a stride just subsamples.
    x, flat = x[:, ::strides[0], ::strides[1]], kernel[0, 0]
    if dot is None:
      return jnp.dot(x.astype(dtype), flat.astype(dtype))
    return dot(x, flat, _FLAT)
  overlapping = kernel_size != strides or any(map(sum, pads))
  if overlapping and not im2col_pays(dtype, kernel, x):
    return lax.conv_general_dilated(x.astype(dtype), kernel.astype(dtype), strides, pads,
                                    dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  if dot is None:  # float32 on TPU and GPU: lax's dot
    return jnp.dot(
        patches(x, kernel_size, strides, pads).astype(dtype),
        kernel.reshape(-1, kernel.shape[-1]).astype(dtype))
  compute_dtype = precision.COMPUTE_DTYPE if precision.is_mixed(dtype) else jnp.float32
  y = _patches_dot(x, kernel, strides, pads, compute_dtype)
  # As precision.dot_general's: a bf16 model's layer names its bf16 output (`layer_output`).
  return y if precision.is_mixed(dtype) else checkpoint_name(y, precision.DOT_NAME)
