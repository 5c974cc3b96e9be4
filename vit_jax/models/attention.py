"""The attention core, softmax(q k^T) v; in a bfloat16 model on the CPU backend, with a
backward that keeps q, k and v only.

Autodiff keeps each block's attention weights for the backward pass, (batch, heads,
tokens, tokens) in float32, and in a bfloat16 model XLA also keeps their bf16 copy (the
second dot's operand): 250 of the 870 MiB live at the bf16 ViT-Ti/16 b32 step's peak.
`attend_recomputing` keeps only its inputs and recomputes the weights in the backward
pass, as PyTorch's fused attention does; the gradients are autodiff's of the same forward.
`attend` uses it where it was measured to pay (`recomputes`). Dots are
precision.py's in a bf16 model (bf16 operands, float32 results), XLA's in float32 (ordered
ones too made the ViT-Ti step 1.02-1.04x flax's against 1.12-1.14x for ordered
projections alone; benchmarks/README.md); the softmax is float32 either way. q is scaled
by the caller.
"""
import functools

import jax
import jax.numpy as jnp

from vit_jax.models import activations
from vit_jax.models import precision

# q (b, q, h, d) . k (b, k, h, d) -> (b, h, q, k); weights (b, h, q, k) . v (b, k, h, d) ->
# (b, h, q, d), heads-major as the output projection takes it (vit.py).
_LOGITS = (((3,), (3,)), ((0, 2), (0, 2)))
_VALUES = (((3,), (1,)), ((0, 1), (0, 2)))


def weights(q, k, dtype):
  """softmax(q k^T) over the keys, float32, (batch, heads, queries, keys)."""
  if precision.is_mixed(dtype):
    logits = precision.dot_general(q, k, _LOGITS)
  else:
    logits = jnp.einsum('bqhd,bkhd->bhqk', q, k, preferred_element_type=jnp.float32)
  return activations.softmax(logits)


def values(attention_weights, v, dtype):
  """The weights' average of v, (batch, heads, queries, head_dim): float32 in a bf16 model
  (precision.py's dot), else v's dtype."""
  if precision.is_mixed(dtype):
    return precision.dot_general(attention_weights, v, _VALUES)
  return jnp.einsum('bhqk,bkhd->bhqd', attention_weights.astype(v.dtype), v)


def recomputes(dtype):
  """Whether `attend` recomputes the weights in the backward pass: for bfloat16 on the CPU
  backend, where the bf16 ViT-Ti/16 b32 step planned 24% less memory (ViT-B/16 b8 5%,
  R50+ViT-B/16 b8 1%) at medians of 1.03, 0.99 and 0.98 of the speed (benchmarks/README.md,
  sixteenth session). In float32 the weights are kept once, not twice: ViT-Ti/16 planned
  10% less but ran at 0.93-1.00x. Not measured on TPU or GPU, which keep autodiff's."""
  return precision.is_mixed(dtype) and jax.default_backend() == 'cpu'


def attend(q, k, v, dtype):
  """values(weights(q, k), v) for a model computing in `dtype`."""
  if recomputes(dtype):
    return attend_recomputing(q, k, v, dtype)
  return values(weights(q, k, dtype), v, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attend_recomputing(q, k, v, dtype):
  """values(weights(q, k), v), keeping q, k and v for the backward pass."""
  return values(weights(q, k, dtype), v, dtype)


def _attend_fwd(q, k, v, dtype):
  return attend_recomputing(q, k, v, dtype), (q, k, v)


def _attend_bwd(dtype, residuals, g):
  q, k, v = residuals
  # Weights recomputed from a q that depends on g are not merged with the forward pass's
  # own (the same expression), which XLA would then keep alive until here.
  q = precision.depending_on(q, g)
  return jax.vjp(lambda q, k, v: values(weights(q, k, dtype), v, dtype), q, k, v)[1](g)


attend_recomputing.defvjp(_attend_fwd, _attend_bwd)
