"""The models' matmuls: bfloat16 compute with float32 accumulation, forward and backward,
and on XLA:CPU the order of each weight-gradient dot.

`dot_general` has the signature of `lax.dot_general` (flax's `dot_general` hook, the
`_dot_general` of `jnp.einsum`): it rounds both operands to bfloat16 and returns the
float32 result of a float32-accumulated dot. Its backward does the same for the two
gradient dots (the cotangent is rounded to bfloat16), so every matmul of a train step
is bf16 x bf16 -> f32. JAX's own transpose of a dot with `preferred_element_type=f32`
would multiply the f32 cotangent with the bf16 operand, which XLA runs as an f32 dot;
and a dot with bf16 results is, on XLA:CPU, no faster than f32 (benchmarks/README.md).
Operands keep their dtypes outside: a float32 kernel gets a float32 gradient,
accumulated in float32 and never rounded to bf16.

`float32_dot_general` is the same custom VJP on float32 operands: the same products and
float32 sums as flax's own dots, each weight gradient in the order that
`_cotangent_transposed_is_cheaper` picks. On XLA:CPU the float32 train step ran
1.02-1.15x faster with it (ViT-Ti/16, ViT-B/16, R50+ViT-B/16, YNNPACK on and off;
benchmarks/README.md): XLA:CPU copies an operand of each weight-gradient dot transposed,
and this order copies the smaller one.

On an NVIDIA GPU with bf16 tensor cores (Ampere or later) a bf16 model does not use these
dots (`is_mixed`): XLA's own bf16 dots there accumulate in float32 too (cuBLAS, Triton) and
return bf16, as `torch.autocast` does, and the step ran faster with them: bf16 ViT-B/16 b128
1.065x on an H200 with cuDNN's fused attention, 1.01-1.05x on an H100 without it
(benchmarks/README.md, thirtieth and fifteenth sessions; `before_after.py --change
mixed_dots`). Half the bytes of a float32 result go through every elementwise op around
each dot. Not measured on a TPU, which keeps this module's dots.

`dense_options(dtype)` are the flax Dense/DenseGeneral fields for a model computing in
`dtype`: where `is_mixed`, inputs cast to bf16, kernel and bias left float32 (the bias is
added to the float32 result); for float32 on the CPU backend, `float32_dot_general`;
otherwise none, i.e. flax's own dots (TPU and GPU lay out transposes themselves; a bf16
model's flax dots cast the kernel to bf16 and return bf16). `dense_options(dtype,
activation)` is for a layer of activation(inputs) that computes the activation again in its
backward pass (`of_activation`, on any of those dots: remat.py's 'gelu').

`layer_output(y, dtype)` casts a layer's output to the model's dtype and names it for the
dots remat policies (remat.py): float32 dots name their own results; where `is_mixed` the
layer's bf16 output is named, which a policy keeps in half the bytes of the dot's float32
result (XLA's own dots are dots to the policies).
"""
import functools

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np

from vit_jax.models import accelerator

COMPUTE_DTYPE = jnp.bfloat16
# The names of these dots' results for remat policies (remat.py): jax.checkpoint's dot
# policies see a custom VJP's result as not a dot's.
DOT_NAME = 'precision_dot'
BATCHED_DOT_NAME = 'precision_batched_dot'


def _dot(lhs, rhs, dimension_numbers, compute_dtype):
  return lax.dot_general(lhs.astype(compute_dtype), rhs.astype(compute_dtype), dimension_numbers,
                         preferred_element_type=jnp.float32)


def dot_gradients(g, lhs, rhs, dimension_numbers, compute_dtype, lhs_grad_dtype=None):
  """The gradients of both operands of `_dot` for its cotangent `g`, in the operands' dtypes
  (lhs's in `lhs_grad_dtype` if given). Each is a `compute_dtype` dot with a float32 result,
  ordered so that it needs no transpose in the common cases (dense layers): XLA:CPU folds a
  transpose into the dot, and YNNPACK does not take the folded form, whose fallback kernel
  has no bf16 x bf16 -> f32 (UNIMPLEMENTED at run time)."""
  (c_lhs, c_rhs), (b_lhs, b_rhs) = dimension_numbers
  kept_lhs = [i for i in range(lhs.ndim) if i not in c_lhs and i not in b_lhs]
  kept_rhs = [i for i in range(rhs.ndim) if i not in c_rhs and i not in b_rhs]
  # g's axes, as the forward result's: batch, lhs kept, rhs kept.
  nb, nl = len(b_lhs), len(kept_lhs)
  g_batch = tuple(range(nb))
  g_lhs_kept = tuple(range(nb, nb + nl))
  g_rhs_kept = tuple(range(nb + nl, g.ndim))
  g = g.astype(compute_dtype)
  if not b_lhs:
    rhs = kernel_for_backward(rhs, g, lhs.size, compute_dtype)
  lhs16, rhs16 = lhs.astype(compute_dtype), rhs.astype(compute_dtype)
  f32 = jnp.float32
  # d lhs = g . rhs over rhs's kept axes: batch, lhs kept, rhs contracting (sorted).
  d_lhs = lax.dot_general(g, rhs16, ((g_rhs_kept, tuple(kept_rhs)), (g_batch, tuple(b_rhs))),
                          preferred_element_type=f32)
  source = list(b_lhs) + kept_lhs + [c_lhs[list(c_rhs).index(j)] for j in sorted(c_rhs)]
  d_lhs = jnp.transpose(d_lhs, np.argsort(source))
  rhs_contracting = [c_rhs[list(c_lhs).index(j)] for j in sorted(c_lhs)]
  if _cotangent_transposed_is_cheaper(g, lhs, rhs, b_lhs, compute_dtype):
    # d rhs^T = g . lhs over lhs's kept axes: rhs kept, rhs contracting; the barrier keeps
    # XLA from folding the transpose below back into the dot (lhs . g again).
    d_rhs = lax.dot_general(g, lhs16, ((g_lhs_kept, tuple(kept_lhs)), ((), ())),
                            preferred_element_type=f32)
    d_rhs = lax.optimization_barrier(d_rhs)
    source = kept_rhs + rhs_contracting
  else:
    # d rhs = lhs . g over lhs's kept axes: batch, lhs contracting (sorted), rhs kept.
    d_rhs = lax.dot_general(lhs16, g, ((tuple(kept_lhs), g_lhs_kept), (tuple(b_lhs), g_batch)),
                            preferred_element_type=f32)
    source = list(b_rhs) + rhs_contracting + kept_rhs
  d_rhs = jnp.transpose(d_rhs, np.argsort(source))
  if not b_lhs and jax.default_backend() == 'cpu':
    d_lhs = after_weight_gradient(d_lhs, d_rhs)
  return d_lhs.astype(lhs_grad_dtype or lhs.dtype), d_rhs.astype(rhs.dtype)


def kernel_for_backward(kernel, g, input_size, compute_dtype):
  """A wider `kernel` as the backward pass of its `compute_dtype` dot reads it. XLA merges
  the bf16 copy made there for the input gradient with the forward pass's (the same
  expression) and keeps it alive from one to the other. On XLA:CPU, where a kernel has at
  least a quarter as many elements as the dot's other operand (`input_size`), the copy is
  made again from a kernel that depends on the cotangent `g`: the bf16 ViT-B/16 b8 step
  planned 1.23 GiB instead of 1.38 and R50+ViT-B/16 b8 1.73 instead of 1.89, at medians of
  0.97x and 0.98x the speed. Smaller kernels keep their copy: at ViT-Ti/16 b32 the copies
  were 1% of the planned memory and making them again cost 2-3% of the speed
  (benchmarks/README.md, fifty-fifth session). Not measured on TPU or GPU, which keep the
  merged copies."""
  if (kernel.dtype == compute_dtype or 4 * kernel.size < input_size
      or jax.default_backend() != 'cpu'):
    return kernel
  return depending_on(kernel, g.ravel()[:1])


def after_weight_gradient(d_lhs, d_rhs):
  """The input gradient `d_lhs` of an unbatched dot, as a value computed after its weight
  gradient `d_rhs`. A weight gradient is needed only by the optimizer, and XLA:CPU's
  memory-optimised scheduler defers every one to the end of the backward pass, each
  keeping its operands (the layer's input, the cotangent) alive until then. Tied to the
  input's gradient, which the backward pass needs next, it runs at once and frees them
  (planned memory up to 29% less, benchmarks/README.md). One element ties it: a sum of all
  cost 2-4%."""
  return depending_on(d_lhs, d_rhs.ravel()[:1])


def depending_on(x, dependency):
  """`x`, as a value XLA cannot compute before `dependency`: nothing computed from it is
  merged with the same expression earlier in the step, or scheduled before `dependency`.
  0 * sum(dependency) is not simplified away (0 * nan is nan)."""
  return x + (jnp.sum(dependency, dtype=jnp.float32) * 0).astype(x.dtype)


def _cotangent_transposed_is_cheaper(g, lhs, rhs, lhs_batch, compute_dtype):
  """Whether the weight gradient (no batch axes) moves fewer bytes as (g^T lhs)^T than as
  lhs^T g, on XLA:CPU. Its kernels want the contracted axes last on the left, so the dot
  contracting both operands' leading (token) axes first copies one of them transposed:
  lhs for lhs^T g; g plus the f32 result's transpose for the other order. In bf16, at
  ViT-Ti/16's MLP output layer, b32 (lhs 6304x768, g 6304x192), that is 1.5M against
  4.8M bf16 elements (bf16 step 1.02-1.06x faster, benchmarks/README.md); at ViT-B/16's,
  b8 (1576x3072, 1576x768), 5.9M against 4.8M: lhs^T g stays (in float32 it does not)."""
  if lhs_batch or jax.default_backend() != 'cpu':
    return False
  width = jnp.dtype(compute_dtype).itemsize
  return width * g.size + 4 * rhs.size < width * lhs.size


def _dot_fwd(lhs, rhs, dimension_numbers, compute_dtype):
  return _dot(lhs, rhs, dimension_numbers, compute_dtype), (lhs, rhs)


def _dot_bwd(dimension_numbers, compute_dtype, residuals, g):
  lhs, rhs = residuals
  return dot_gradients(g, lhs, rhs, dimension_numbers, compute_dtype)


_dot = jax.custom_vjp(_dot, nondiff_argnums=(2, 3))
_dot.defvjp(_dot_fwd, _dot_bwd)


def _dot_general_in(compute_dtype):
  """A lax.dot_general-signature function: operands in `compute_dtype`, float32 result."""

  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                  **unused):
    del precision, preferred_element_type, unused  # always compute_dtype operands, f32 result
    (c_lhs, c_rhs), (b_lhs, b_rhs) = dimension_numbers
    dimension_numbers = ((tuple(c_lhs), tuple(c_rhs)), (tuple(b_lhs), tuple(b_rhs)))
    result = _dot(lhs, rhs, dimension_numbers, compute_dtype)
    if b_lhs:
      return checkpoint_name(result, BATCHED_DOT_NAME)
    # A bf16 model's layer names its output instead, rounded to bf16 (`layer_output`).
    return result if compute_dtype == COMPUTE_DTYPE else checkpoint_name(result, DOT_NAME)

  return dot_general


# lax.dot_general on bf16-rounded operands with a float32 result, and on float32 operands
# (see the module doc).
dot_general = _dot_general_in(COMPUTE_DTYPE)
float32_dot_general = _dot_general_in(jnp.float32)


def layer_output(y, dtype):
  """A layer's output: `y` (its dot plus any bias) cast to the model's `dtype`; in a bf16
  model named for the dots remat policies, which then keep it, half the bytes of the dot's
  float32 result, and recompute the rest."""
  y = y.astype(dtype)
  return checkpoint_name(y, DOT_NAME) if is_mixed(dtype) else y


def of_activation(dot_general, activation):
  """`dot_general` (lax.dot_general's signature) of activation(lhs), whose backward keeps lhs,
  not activation(lhs), and computes the activation again: one array of the activation's
  size fewer kept per layer, for one more evaluation of it (remat.py's 'gelu')."""

  def plain_dot(lhs, rhs, options):  # options: dot_general's other (args, sorted kwargs)
    return dot_general(lhs, rhs, *options[0], **dict(options[1]))

  @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
  def dot(lhs, rhs, options):
    return plain_dot(activation(lhs), rhs, options)

  def forward(lhs, rhs, options):
    return dot(lhs, rhs, options), (lhs, rhs)

  def backward(options, residuals, g):
    lhs, rhs = residuals
    # Computed again from an lhs that depends on g, so that XLA does not merge it with the
    # forward pass's activation (the same expression) and keep that alive until here.
    activated, activation_vjp = jax.vjp(activation, depending_on(lhs, g.ravel()[:1]))
    _, dot_vjp = jax.vjp(lambda a, r: plain_dot(a, r, options), activated, rhs)
    d_activated, d_rhs = dot_vjp(g)
    return activation_vjp(d_activated)[0], d_rhs

  dot.defvjp(forward, backward)

  def dot_general_of_activation(lhs, rhs, *args, **kwargs):
    return dot(lhs, rhs, (args, tuple(sorted(kwargs.items()))))

  return dot_general_of_activation


def _promote_inputs_only(inputs, kernel, bias, dtype=None, inexact=True):
  del inexact
  return [inputs.astype(dtype), kernel, bias]


def is_mixed(dtype):
  """Whether a model computing in `dtype` uses this module's bf16 x bf16 -> f32 dots: in
  bfloat16, except on an NVIDIA GPU with bf16 tensor cores (module doc)."""
  return (jnp.dtype(dtype) == jnp.dtype(COMPUTE_DTYPE)
          and not accelerator.is_ampere_or_later_nvidia_gpu())


def dot_general_for(dtype):
  """The dot_general of a model computing in `dtype` (see the module doc), or None for
  lax's own."""
  if is_mixed(dtype):
    return dot_general
  if jnp.dtype(dtype) == jnp.float32 and jax.default_backend() == 'cpu':
    return float32_dot_general
  return None


def dense_options(dtype, activation=None):
  """Fields for nn.Dense / nn.DenseGeneral of a model computing in `dtype`; with
  `activation`, for a layer of activation(inputs) (`of_activation`)."""
  dot = dot_general_for(dtype)
  if activation is not None:
    dot = of_activation(dot or lax.dot_general, activation)
  if dot is None:
    return {}
  if is_mixed(dtype):
    return {'dot_general': dot, 'promote_dtype': _promote_inputs_only}
  return {'dot_general': dot}
