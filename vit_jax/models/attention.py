"""The attention core, softmax(q k^T) v; on the CPU backend, with a backward that keeps q,
k and v only; in a bfloat16 model on a GPU, cuDNN's fused attention.

Autodiff keeps each block's attention weights for the backward pass, (batch, heads,
tokens, tokens) in float32, and in a bfloat16 model XLA also keeps their bf16 copy (the
second dot's operand): 250 of the 870 MiB live at the bf16 ViT-Ti/16 b32 step's peak.
`attend_recomputing` keeps only its inputs and recomputes the weights in the backward
pass, as PyTorch's fused attention does; the gradients are autodiff's of the same forward.
`attend` uses it where it was measured to pay (`recomputes`), and in float32 on the CPU
runs the core over chunks of the batch (`batch_chunks`). Dots are
precision.py's where it has them (`precision.is_mixed`: bf16 operands, float32 results),
else XLA's (in a bf16 model on an NVIDIA GPU bf16 results; in float32, ordered
ones too made the ViT-Ti step 1.02-1.04x flax's against 1.12-1.14x for ordered
projections alone; benchmarks/README.md); the softmax is float32 either way. q is scaled
by the caller.

On an NVIDIA GPU, a bf16 model's attention is `attend_fused` (`fuses`): cuDNN's flash
attention, which never writes the (batch, heads, tokens, tokens) logits or weights to
memory and recomputes them in its backward pass. It computes the same thing: bf16 q, k
and v, float32 logits and softmax, the weights rounded to bf16 for their dot with v,
float32 accumulation. Its output is tokens-major (batch, tokens, heads, head_dim). On an
H200 the bf16 ViT-B/16 b128 step ran 1.19-1.25x faster and planned 9.0 GiB instead of
12.7 (benchmarks/README.md, eighteenth session).
"""
import functools

import jax
import jax.numpy as jnp

from vit_jax.models import accelerator
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
  """Whether `attend` recomputes the weights in the backward pass: on the CPU backend. In
  bfloat16 the ViT-Ti/16 b32 step planned 24% less memory (ViT-B/16 b8 5%, R50+ViT-B/16 b8
  1%) at medians of 1.03, 0.99 and 0.98 of the speed (benchmarks/README.md, sixteenth
  session). In float32, where the weights are kept once, not twice, it buys less (ViT-Ti/16
  b32 1.05 -> 0.96 GiB planned) for 0.95-0.97x of the step's speed (fifty-fifth session),
  but it brings the step's peak RSS under PyTorch's, which autodiff's attention left
  1.01-1.03x over (fifty-eighth session). Not measured on TPU or GPU, which keep
  autodiff's."""
  del dtype  # (both dtypes; the signature is the callers')
  return jax.default_backend() == 'cpu'


def fuses(dtype, head_dim):
  """Whether the attention is `attend_fused`: for bfloat16 (cuDNN's flash attention takes
  bf16 and fp16 only) on an NVIDIA GPU it runs on (Ampere or later: not Colab's T4), with a
  head size it takes on each of them (a multiple of 8 up to 128; the paper's ViTs have 64
  or 80). Elsewhere the unfused core runs."""
  return (jnp.dtype(dtype) == jnp.dtype(precision.COMPUTE_DTYPE)
          and accelerator.is_ampere_or_later_nvidia_gpu() and head_dim % 8 == 0 and head_dim <= 128)


def attend_fused(q, k, v, key_tokens=None, implementation='cudnn'):
  """values(weights(q, k), v) as one fused op, tokens-major (batch, queries, heads,
  head_dim) in q's dtype. `key_tokens`: only the first key_tokens keys are attended to (the
  rest pad the tokens to an even count; vit.py's encoder pads once for all its blocks).
  `implementation` as jax.nn.dot_product_attention takes it ('xla' computes the same thing
  unfused, on any backend)."""
  tokens = q.shape[1]
  if key_tokens is None and tokens % 2 == 0:
    return jax.nn.dot_product_attention(q, k, v, scale=1.0, implementation=implementation)
  # cuDNN's training path refuses an odd number of tokens (ViT's 196 + 1): JAX hands it an
  # empty bias that its check counts as a bias. One padded token, masked out as a key and
  # sliced off as a query, makes it even.
  padded = key_tokens is None
  if padded:
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0)))
    q, k, v, key_tokens = pad(q), pad(k), pad(v), tokens
  lengths = jnp.full((q.shape[0],), key_tokens, jnp.int32)
  y = jax.nn.dot_product_attention(q, k, v, scale=1.0, key_value_seq_lengths=lengths,
                                   implementation=implementation)
  return y[:, :tokens] if padded else y


# At most this many batch chunks (batch_chunks).
MAX_CHUNKS = 4


def batch_chunks(batch, dtype):
  """How many equal batch chunks `attend` runs the core in: in float32 on the CPU backend
  with one device, the largest divisor of `batch` up to MAX_CHUNKS, else 1.

  XLA:CPU runs a batched dot's matrices one after another, as fast on one core as on two
  (the ViT-Ti/16 b32 logits dot: 57-75 GFLOP/s either way, where a 2048^3 dot runs at 160
  on two cores and 92 on one), and its memory-optimised schedule runs the core's dots one
  after another too. Chunks are independent pieces, each with logits a fraction of the
  size. On host F's model (benchmarks/README.md, sixty-fourth session) one block's core
  forward and backward at ViT-Ti/16 b32 shapes took 42-49 ms (medians) in 4 chunks against
  74-81 in one (89-96 against 109-138 pinned to one core), but inside the step the executor
  runs the forward chunks one after another (sixty-fifth session), and the float32 train
  steps in 4 chunks ran at medians of 1.06x (ViT-Ti/16 b32, 6 rounds) and 1.05x (ViT-B/16
  b8, R50+ViT-B/16 b8, 3 rounds each). 8 chunks ran ViT-Ti/16 at about the same speed
  (medians 1.06-1.08x) with 0.07 GiB more peak RSS (over PyTorch's) and twice the compile
  time's increase (7.7 -> 11-15 s; 4 chunks 8-11 s). On host C's model (Zen 4, sixty-eighth
  session) the float32 chunks ran the step at a median of 0.99x (ViT-Ti/16, 10 rounds) and
  1.02x (ViT-B/16, 4): no loss. bfloat16 keeps one chunk: there 4 chunks ran ViT-B/16 b8 at
  0.84-0.92x. Several devices, whose batch is sharded, keep one chunk too.
  """
  if jnp.dtype(dtype) != jnp.float32 or not one_cpu_device():
    return 1
  return max(c for c in range(1, MAX_CHUNKS + 1) if batch % c == 0)


def one_cpu_device():
  """Whether the backend is the CPU with one device, which holds the whole batch (chunks of a
  batch sharded over several would each lie on some of them)."""
  return jax.default_backend() == 'cpu' and jax.device_count() == 1


def core(q, k, v, dtype):
  """values(weights(q, k), v), recomputing the weights in the backward pass where
  `recomputes`."""
  if recomputes(dtype):
    return attend_recomputing(q, k, v, dtype)
  return values(weights(q, k, dtype), v, dtype)


def attend(q, k, v, dtype):
  """values(weights(q, k), v) for a model computing in `dtype`: `core`, over
  `batch_chunks` chunks of the batch."""
  chunks = batch_chunks(q.shape[0], dtype)
  if chunks == 1:
    return core(q, k, v, dtype)
  pieces = zip(*(jnp.split(x, chunks) for x in (q, k, v)))
  return jnp.concatenate([core(*piece, dtype) for piece in pieces])


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
