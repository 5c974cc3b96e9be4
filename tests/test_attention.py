"""Tests for vit_jax.models.attention: the recomputing core's values and gradients are
autodiff's of the same forward, it keeps only q, k and v, and where `attend` uses it the
compiled step plans less memory; the fused attention (cuDNN's on a GPU, XLA's same formula
elsewhere) is the same attention, in the model too."""
import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from tests import planned_memory
from vit_jax import models
from vit_jax.models import accelerator
from vit_jax.models import attention
from vit_jax.models import vit


def _qkv(dtype, b=2, n=7, h=3, d=8):
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v = (jax.random.normal(key, (b, n, h, d)).astype(dtype) for key in keys[:3])
  g = jax.random.normal(keys[3], (b, h, n, d))
  return q, k, v, g


def _plain(q, k, v, dtype):
  return attention.values(attention.weights(q, k, dtype), v, dtype)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_values_and_gradients_are_autodiffs_of_the_same_forward(dtype):
  q, k, v, g = _qkv(dtype)
  y, vjp = jax.vjp(lambda q, k, v: attention.attend_recomputing(q, k, v, dtype), q, k, v)
  y_plain, vjp_plain = jax.vjp(lambda q, k, v: _plain(q, k, v, dtype), q, k, v)
  assert y.dtype == y_plain.dtype == (jnp.float32 if dtype == jnp.bfloat16 else dtype)
  np.testing.assert_array_equal(y, y_plain)
  g = g.astype(y.dtype)
  for ours, theirs in zip(vjp(g), vjp_plain(g)):
    assert ours.dtype == dtype
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32),
                               rtol=1e-6, atol=1e-6)


def test_gradients_are_the_softmax_attentions():
  # Against a float32 formula written out here, at float32 precision.
  q, k, v, g = _qkv(jnp.float32)
  reference = lambda q, k, v: jnp.einsum(
      'bhqk,bkhd->bhqd', jax.nn.softmax(jnp.einsum('bqhd,bkhd->bhqk', q, k), axis=-1), v)
  ours = jax.vjp(lambda q, k, v: attention.attend_recomputing(q, k, v, jnp.float32), q, k, v)[1](g)
  for a, b in zip(ours, jax.vjp(reference, q, k, v)[1](g)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_keeps_no_attention_weights(dtype, capsys):
  # q, k, v are kept (here inputs, so printed as arguments); no (b, h, q, k) value is, while
  # the plain composition keeps the weights (in bf16 also as the second dot's operand).
  q, k, v, _ = _qkv(jnp.dtype(dtype))
  for fn, kept in ((attention.attend_recomputing, False), (_plain, True)):
    jax.ad_checkpoint.print_saved_residuals(
        lambda q, k, v, fn=fn: jnp.sum(jnp.sin(fn(q, k, v, jnp.dtype(dtype)))), q, k, v)
    out = capsys.readouterr().out
    assert bool(re.search(r'\[2,3,7,7\]', out)) == kept, out


def test_attend_recomputes_on_cpu_only():
  on_cpu = jax.default_backend() == 'cpu'
  assert attention.recomputes(jnp.bfloat16) == on_cpu
  assert attention.recomputes(jnp.float32) == on_cpu


# Measured on the CPU: 0.67 of the plain attention's temporaries in bf16 (the weights kept
# in float32 and as the bf16 operand), 0.89 in float32 (kept once).
@pytest.mark.parametrize('dtype, fraction', [('bfloat16', 0.85), ('float32', 0.95)])
def test_the_compiled_step_plans_less_memory(dtype, fraction, monkeypatch):
  if not attention.recomputes(jnp.dtype(dtype)):
    pytest.skip('the plain attention on this backend')
  lean = planned_memory.vit_step_temporaries_mb(dtype)
  monkeypatch.setattr(attention, 'core', _plain)
  assert lean < fraction * planned_memory.vit_step_temporaries_mb(dtype)


def test_float32_on_one_cpu_device_runs_the_core_in_chunks(monkeypatch):
  monkeypatch.setattr(attention, 'one_cpu_device', lambda: True)
  chunks = {b: attention.batch_chunks(b, jnp.float32) for b in (1, 6, 7, 9, 12, 32, 256)}
  assert chunks == {1: 1, 6: 3, 7: 1, 9: 3, 12: 4, 32: 4, 256: 4}  # up to MAX_CHUNKS
  assert attention.batch_chunks(32, jnp.bfloat16) == 1
  monkeypatch.setattr(attention, 'one_cpu_device', lambda: False)
  assert attention.batch_chunks(32, jnp.float32) == 1


def test_one_cpu_device_is_the_cpu_backend_with_one_device():
  # The suite runs on 8 CPU devices (conftest.py), the CLI's journeys on one.
  assert attention.one_cpu_device() == (jax.default_backend() == 'cpu' and jax.device_count() == 1)


def test_the_core_in_chunks_computes_the_core_over_the_whole_batch(monkeypatch):
  monkeypatch.setattr(attention, 'one_cpu_device', lambda: True)
  q, k, v, g = _qkv(jnp.float32, b=8)
  attend = lambda q, k, v: attention.attend(q, k, v, jnp.float32)
  core = lambda q, k, v: attention.core(q, k, v, jnp.float32)
  if attention.recomputes(jnp.float32):  # a recomputing core per chunk of 2 examples
    eqns = jax.make_jaxpr(attend)(q, k, v).jaxpr.eqns
    assert [e.primitive.name for e in eqns].count('custom_vjp_call') == 4
  y, vjp = jax.vjp(attend, q, k, v)
  y_whole, vjp_whole = jax.vjp(core, q, k, v)
  np.testing.assert_allclose(y, y_whole, rtol=1e-6, atol=1e-6)
  for ours, theirs in zip(vjp(g), vjp_whole(g)):
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)


def test_the_weights_are_still_sown_and_attention_dropout_still_applies():
  model = models.get_model('ViT-Ti_16', num_classes=3, num_layers=1, patch_size=8)
  x = jnp.ones((1, 32, 32, 3))
  params = model.init(jax.random.PRNGKey(0), x, train=False)
  head = params['params']['head']
  head['kernel'] = jax.random.normal(jax.random.PRNGKey(1), head['kernel'].shape)  # not zeros
  _, state = model.apply(params, x, train=False, mutable=['intermediates'])
  block = state['intermediates']['Transformer']['encoderblock_0']
  weights, = block['MultiHeadDotProductAttention_1']['attention_weights']
  assert weights.shape == (1, 3, 17, 17)
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
  dropped = models.get_model('ViT-Ti_16', num_classes=3, num_layers=1, patch_size=8,
                             attention_dropout_rate=0.5)
  run = lambda seed: dropped.apply(params, x, train=True, rngs=
                                   {'dropout': jax.random.PRNGKey(seed)})
  assert not np.allclose(run(0), run(1))
  np.testing.assert_array_equal(dropped.apply(params, x, train=False),
                                model.apply(params, x, train=False))


# cuDNN's fused attention where there is one; elsewhere jax's unfused formula of the same op,
# which checks our use of it (layout, scale) but not cuDNN's kernel.
_FUSED = 'cudnn' if jax.default_backend() == 'gpu' else 'xla'


def _close_in_bf16(ours, theirs):
  """Equal up to a few bf16 roundings, relative to the array's scale."""
  ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
  scale = np.abs(theirs).max()
  assert scale > 0
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=0.03 * scale)


def test_attend_fuses_in_bf16_on_an_ampere_or_later_gpu_with_a_head_size_cudnn_takes(monkeypatch):
  flash = accelerator.cuda_capability() >= 8.0
  assert flash == (jax.default_backend() == 'gpu'
                   and float(jax.local_devices()[0].compute_capability) >= 8.0)
  assert attention.fuses(jnp.bfloat16, 64) == flash
  cases = [
      (9.0, 64, True),  # an H100: ViT-Ti to ViT-L
      (8.0, 80, True),  # an A100: ViT-H/14
      (9.0, 128, True),
      (7.5, 64, False),  # a T4
      (9.0, 20, False),
      (9.0, 136, False),
      (0.0, 64, False),  # not an NVIDIA GPU
  ]
  for capability, head_dim, fused in cases:
    monkeypatch.setattr(accelerator, 'cuda_capability', lambda capability=capability: capability)
    assert attention.fuses(jnp.bfloat16, head_dim) == fused, (capability, head_dim)
    assert not attention.fuses(jnp.float32, head_dim)


@pytest.mark.parametrize('tokens', [16, 17])  # cuDNN's takes an even count: 17 is padded
def test_fused_attention_is_the_same_attention(tokens):
  q, k, v, g = _qkv(jnp.bfloat16, n=tokens, h=3, d=64)
  y, vjp = jax.vjp(lambda q, k, v: attention.attend_fused(q, k, v, implementation=_FUSED), q, k, v)
  y_plain, vjp_plain = jax.vjp(lambda q, k, v: _plain(q, k, v, jnp.bfloat16), q, k, v)
  assert y.shape == (2, tokens, 3, 64) and y.dtype == jnp.bfloat16  # tokens-major
  _close_in_bf16(y, y_plain.transpose(0, 2, 1, 3))
  # The unfused core's output is float32 where precision.py's dots run, else bf16 (a GPU).
  for ours, theirs in zip(vjp(g.transpose(0, 2, 1, 3).astype(y.dtype)),
                          vjp_plain(g.astype(y_plain.dtype))):
    assert ours.dtype == jnp.bfloat16
    _close_in_bf16(ours, theirs)


def test_fused_attention_over_tokens_padded_by_the_caller_ignores_the_padding():
  # As the encoder calls it (vit.pads_tokens_once): 17 tokens and an 18th, here not zeros,
  # that is no key; the 17 queries' outputs and all gradients are the unpadded attention's.
  q, k, v, g = _qkv(jnp.bfloat16, n=18, h=3, d=64)
  attend = lambda q, k, v: attention.attend_fused(q, k, v, 17, implementation=_FUSED)
  y, vjp = jax.vjp(attend, q, k, v)
  assert y.shape == (2, 18, 3, 64)
  first = lambda x: x[:, :17]
  y_plain, vjp_plain = jax.vjp(lambda q, k, v: _plain(q, k, v, jnp.bfloat16), first(q), first(k),
                               first(v))
  _close_in_bf16(first(y), y_plain.transpose(0, 2, 1, 3))
  g = g.transpose(0, 2, 1, 3).at[:, 17:].set(0)  # the padded query is sliced off
  ours = vjp(g.astype(y.dtype))
  for mine, theirs in zip(ours, vjp_plain(first(g).transpose(0, 2, 1, 3).astype(y_plain.dtype))):
    _close_in_bf16(first(mine), theirs)
  for mine in ours:  # nothing reaches the padded token: its gradients are exactly zero
    np.testing.assert_array_equal(np.asarray(mine[:, 17:], np.float32), 0)


def _fused_here(monkeypatch, implementation=_FUSED):
  """The model's attention fused, by default with _FUSED's implementation."""
  monkeypatch.setattr(attention, 'fuses', lambda dtype, head_dim: True)
  monkeypatch.setattr(
      attention, 'attend_fused',
      lambda q, k, v, key_tokens=None, shipped=attention.attend_fused: shipped(
          q, k, v, key_tokens, implementation=implementation))


@pytest.mark.parametrize('classifier, image_size', [('token', 32), ('gap', 40)])
def test_the_encoder_pads_an_odd_token_count_once_for_all_its_fused_attentions(
    monkeypatch, classifier, image_size):
  # 16 patches and the class token, or 25 patches averaged: each block's attention padded q, k
  # and v (6 pads in two blocks); the encoder pads once. Logits and gradients are the same:
  # in float32 (the padding is the same with bf16 models, whose roundings XLA places
  # differently around a pad; test_a_bf16_model_with_fused_attention_computes_the_same).
  model = models.get_model('ViT-Ti_16', num_classes=5, num_layers=2, patch_size=8,
                           classifier=classifier)
  x = jax.random.normal(jax.random.PRNGKey(2), (2, image_size, image_size, 3))
  params = model.init(jax.random.PRNGKey(0), x, train=False)
  params['params']['head']['kernel'] = jax.random.normal(jax.random.PRNGKey(1),
                                                         params['params']['head']['kernel'].shape)
  _fused_here(monkeypatch, 'xla')  # float32: cuDNN's takes bf16
  weights = jax.random.normal(jax.random.PRNGKey(3), (2, 5))
  loss = lambda p: jnp.sum(model.apply(p, x, train=False) * weights)
  flat = lambda tree: jnp.concatenate(
      [jnp.ravel(g).astype(jnp.float32) for g in jax.tree.leaves(tree)])
  step = lambda: jax.jit(lambda p: (model.apply(p, x, train=False), flat(jax.grad(loss)(p))))

  def pads(jaxpr=None):
    """The pads the forward pass runs (a jitted jnp.pad's body is printed once, not per call)."""
    if jaxpr is None:
      jaxpr = jax.make_jaxpr(lambda p: model.apply(p, x, train=False))(params).jaxpr
    inner = lambda eqn: sum(pads(j) for j in jax.extend.core.jaxprs_in_params(eqn.params))
    return sum((eqn.primitive.name == 'pad') + inner(eqn) for eqn in jaxpr.eqns)

  with jax.default_matmul_precision('highest'):  # not TF32 on a GPU
    once = pads(), step()(params)
    monkeypatch.setattr(vit, 'pads_tokens_once', lambda fused, tokens: False)
    each = pads(), step()(params)
  assert (once[0], each[0]) == (1, 6)
  for ours, theirs in zip(once[1], each[1]):
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * float(jnp.abs(theirs).max()))


def test_a_bf16_model_with_fused_attention_computes_the_same(monkeypatch):
  # The fused path's output projection contracts (heads, head_dim) where the fused op leaves
  # them: the parameters are the same tree, and against the float32 model (at full matmul
  # precision) the fused bf16 model's logits and gradients are as close as the unfused
  # bf16 model's (over all parameters: the key bias's gradient is zero up to rounding).
  model = lambda dtype: models.get_model('ViT-Ti_16', num_classes=5, num_layers=2, patch_size=8,
                                         dtype=dtype)
  x = jax.random.normal(jax.random.PRNGKey(2), (2, 32, 32, 3))
  params = model('float32').init(jax.random.PRNGKey(0), x, train=False)
  params['params']['head']['kernel'] = jax.random.normal(jax.random.PRNGKey(1),
                                                         params['params']['head']['kernel'].shape)

  def logits_and_grads(dtype):
    apply = lambda p: model(dtype).apply(p, x, train=False).astype(jnp.float32)
    flat = lambda tree: jnp.concatenate(
        [jnp.ravel(g).astype(jnp.float32) for g in jax.tree.leaves(tree)])
    # A linear loss: its cotangent is exact, so the errors are the model's own.
    weights = jax.random.normal(jax.random.PRNGKey(3), (2, 5))
    loss = lambda p: jnp.sum(apply(p) * weights)
    # Jitted, as the train step runs: op by op, the test took 63 s instead of 35.
    return jax.jit(lambda p: (apply(p), flat(jax.grad(loss)(p))))(params)

  with jax.default_matmul_precision('highest'):
    reference = logits_and_grads('float32')
  monkeypatch.setattr(attention, 'fuses', lambda dtype, head_dim: False)
  plain = logits_and_grads('bfloat16')
  _fused_here(monkeypatch)
  fused = logits_and_grads('bfloat16')
  for what, ours, theirs, exact in zip(('logits', 'gradients'), fused, plain, reference):
    error = lambda y, exact=exact: float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact))
    assert error(theirs) < 0.03, (what, error(theirs))  # bf16 roundings, not a wrong model
    assert error(ours) < 2 * error(theirs) + 1e-3, (what, error(ours), error(theirs))
