"""The models' GELU, softmax and ReLU: jax.nn's forward values (GELU's computed in
float32), and a backward that keeps one array: GELU its input, softmax and ReLU their output.

GELU is computed in float32 whatever its input's dtype and rounded once to that dtype, as
PyTorch's bf16 GELU is: jax.nn.gelu on bf16 operands rounds each of its operations to
bf16, each a conversion XLA:CPU runs in software. In float32 the ViT-Ti/16 b32 MLP's GELU
(32x197x768) runs 2.8x faster on a 2-core host (5.2 vs 1.9 ms), closer to the exact value
(benchmarks/README.md, fifty-second session; `benchmarks/before_after.py --change
gelu_in_float32`).

jax.nn.gelu's autodiff keeps four arrays of the MLP's hidden size per block beside GELU's
input and output (tanh's output and the products around it), and jax.nn.softmax's keeps
its exp beside its output; XLA:CPU's plan holds on to enough of them to matter. Here the
derivatives are computed from what is kept, GELU's in float32 whatever the input's dtype.
On XLA:CPU the train step plans up to a quarter less memory (most in bfloat16) and the
bf16 ViT steps run a few percent faster (benchmarks/README.md, thirteenth session;
`benchmarks/before_after.py --change lean_activations`).

jax.nn.relu's backward keeps its input, the GroupNorm's output in the ResNets; its output is
the next convolution's input, kept anyway. In bf16 the R50+ViT-B/16 b8 train step plans 7%
less memory with the output kept (benchmarks/README.md, fifty-third session;
`benchmarks/before_after.py --change lean_group_norm`, with normalization.py).
"""
import jax
import jax.numpy as jnp
import numpy as np

_SQRT_2_OVER_PI = np.float32(np.sqrt(2 / np.pi))
_CUBIC = np.float32(0.044715)


def gelu_value(x):
  """GELU, tanh approximation (as the paper's models): jax.nn.gelu(x, approximate=True) in
  float32 (or wider), rounded once to x's dtype."""
  wide = jnp.promote_types(x.dtype, jnp.float32)
  return jax.nn.gelu(x.astype(wide), approximate=True).astype(x.dtype)


@jax.custom_vjp
def gelu(x):
  """gelu_value, whose backward keeps only x."""
  return gelu_value(x)


def _gelu_fwd(x):
  return gelu(x), x


def _gelu_bwd(x, g):
  f32 = jnp.float32
  x = x.astype(f32)
  x2 = x * x
  t = jnp.tanh(_SQRT_2_OVER_PI * x * (1 + _CUBIC * x2))
  # d/dx of x/2 (1 + tanh(c (x + a x^3))).
  slope = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _CUBIC * x2)
  return ((g.astype(f32) * slope).astype(g.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


@jax.custom_vjp
def softmax(logits):
  """jax.nn.softmax over the last axis."""
  return jax.nn.softmax(logits, axis=-1)


def _softmax_fwd(logits):
  p = softmax(logits)
  return p, p


def _softmax_bwd(p, g):
  return (p * (g - jnp.sum(g * p, axis=-1, keepdims=True)),)


softmax.defvjp(_softmax_fwd, _softmax_bwd)


@jax.custom_vjp
def relu(x):
  """jax.nn.relu, whose backward keeps its output (the next layer's input, kept anyway)
  rather than its input."""
  return jax.nn.relu(x)


def _relu_fwd(x):
  y = relu(x)
  return y, y


def _relu_bwd(y, g):
  return (jnp.where(y > 0, g, jnp.zeros_like(g)),)


relu.defvjp(_relu_fwd, _relu_bwd)
