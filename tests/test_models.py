"""Tests for vit_jax.models: the variant table, parameter counts, forward passes, options."""
import re

import flax
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import models
from vit_jax import xla_cpu_flags
from vit_jax.models import accelerator
from vit_jax.models import attention
from vit_jax.models import precision
from vit_jax.models import remat as remat_lib
from vit_jax.models import resnet

# Exact parameter counts at 224 px and 1000 classes, from jax.eval_shape. Independent
# cross-checks: timm's published counts for the same architectures agree for ViT-Ti/S/B/L/H
# (5.72M/22.05M/86.57M/304.33M/632.05M), R26+ViT-S/32 (36.43M), R50+ViT-L/32 (328.99M) and
# BiT R50x1/R50x3/R101x1/R101x3/R152x2/R152x4 (25.55M/217.32M/44.54M/387.93M/236.34M/936.53M).
PARAM_COUNTS = {
    'ViT-Ti_8': 5_719_720,
    'ViT-Ti_14': 5_694_376,
    'ViT-Ti_16': 5_717_416,
    'ViT-Ti_32': 6_131_560,
    'ViT-S_8': 22_055_272,
    'ViT-S_14': 22_004_584,
    'ViT-S_16': 22_050_664,
    'ViT-S_32': 22_878_952,
    'ViT-B_8': 86_576_872,
    'ViT-B_14': 86_475_496,
    'ViT-B_16': 86_567_656,
    'ViT-B_32': 88_224_232,
    'ViT-L_8': 304_338_920,
    'ViT-L_14': 304_203_752,
    'ViT-L_16': 304_326_632,
    'ViT-L_32': 306_535_400,
    'ViT-H_8': 632_214_760,
    'ViT-H_14': 632_045_800,
    'ViT-H_16': 632_199_400,
    'ViT-H_32': 634_960_360,
    'R50+ViT-B_16': 98_659_112,
    'R50+ViT-B_32': 110_945_832,
    'R50+ViT-L_16': 316_483_624,
    'R50+ViT-L_32': 328_994_856,
    'R26+ViT-B_32': 101_383_976,
    'R26+ViT-S_32': 36_431_912,
    'R+ViT-Ti_16': 6_337_704,
    'BiT-S-R50x1': 25_549_352,
    'BiT-S-R50x3': 217_319_080,
    'BiT-S-R101x1': 44_541_480,
    'BiT-S-R101x3': 387_934_888,
    'BiT-S-R152x2': 236_335_208,
    'BiT-S-R152x4': 936_533_224,
    'BiT-M-R50x1': 25_549_352,
    'BiT-M-R50x3': 217_319_080,
    'BiT-M-R101x1': 44_541_480,
    'BiT-M-R101x3': 387_934_888,
    'BiT-M-R152x2': 236_335_208,
    'BiT-M-R152x4': 936_533_224,
    'R50x1': 25_549_352,
    'R50x2': 97_988_712,
    'R101x1': 44_541_480,
    'R152x1': 60_185_128,
    'R152x2': 236_335_208,
    'R200x3': 568_633_000,
}


def _num_params(model, image_size=224):
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(
      0), jnp.zeros((1, image_size, image_size, 3)), train=False))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes['params']))


def test_every_variant_has_a_pinned_count():
  assert set(PARAM_COUNTS) == set(models.VARIANTS)


@pytest.mark.parametrize('name', sorted(PARAM_COUNTS))
def test_param_count(name):
  assert _num_params(models.get_model(name, num_classes=1000)) == PARAM_COUNTS[name]


@pytest.mark.parametrize('name,paper', [('ViT-B_16', 86e6), ('ViT-L_16', 307e6),
                                        ('ViT-H_14', 632e6)])
def test_table1_param_counts_within_1_percent(name, paper):
  n = _num_params(models.get_model(name, num_classes=1000))
  assert abs(n / paper - 1) < 0.01, (name, n)


def test_required_names_exist():
  required = [
      'ViT-Ti_16', 'ViT-S_16', 'ViT-S_32', 'ViT-B_8', 'ViT-B_16', 'ViT-B_32', 'ViT-L_16',
      'ViT-L_32', 'ViT-H_14', 'R50+ViT-B_16', 'R50+ViT-L_32', 'R26+ViT-B_32', 'R26+ViT-S_32',
      'R+ViT-Ti_16', 'R50x1', 'R50x2', 'R101x1', 'R152x1', 'R152x2', 'R200x3'
  ] + [f'BiT-{d}-R{r}' for d in 'SM' for r in ('50x1', '50x3', '101x1', '101x3', '152x2', '152x4')]
  assert not set(required) - set(models.VARIANTS)


def _images(n=2, size=32, seed=0):
  return jax.random.uniform(jax.random.PRNGKey(seed), (n, size, size, 3), minval=-1, maxval=1)


# Small members of each family, with overrides that keep them fast on CPU.
FAMILIES = {
    'vit': ('ViT-Ti_16', dict(num_layers=2, patch_size=8), 32),
    'vit_gap_prelogits': ('ViT-S_32',
                          dict(num_layers=1, patch_size=8, classifier='gap',
                               representation_size=24), 32),
    'hybrid': ('R26+ViT-S_32', dict(num_layers=1, resnet_layers=(1, 1)), 32),
    'hybrid_root_only': ('R+ViT-Ti_16', dict(num_layers=1), 64),
    'bit': ('BiT-M-R50x1', dict(resnet_layers=(1, 1, 1)), 32),
}


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_forward_every_family(family):
  name, overrides, size = FAMILIES[family]
  model = models.get_model(name, num_classes=7, **overrides)
  x = _images(size=size)
  params = model.init(jax.random.PRNGKey(0), x, train=False)['params']
  # Heads start at zero; give them values so the logits depend on the input.
  params = flax.core.unfreeze(params)
  params['head']['kernel'] = jax.random.normal(jax.random.PRNGKey(1),
                                               params['head']['kernel'].shape)
  logits = model.apply({'params': params}, x, train=False)
  assert logits.shape == (2, 7) and logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))
  assert not np.allclose(logits[0], logits[1])  # different images, different logits
  features = models.get_model(name, num_classes=0, **overrides).apply(
      {'params': {
          k: v for k, v in params.items() if k != 'head'
      }}, x, train=False)
  np.testing.assert_allclose(features @ params['head']['kernel'] + params['head']['bias'], logits,
                             rtol=1e-4, atol=1e-4)


def test_heads_and_class_token_start_at_zero():
  model = models.get_model('ViT-Ti_16', num_classes=5, num_layers=1, head_bias_init=-10.0)
  params = model.init(jax.random.PRNGKey(0), _images(), train=False)['params']
  assert not np.any(params['head']['kernel']) and not np.any(params['cls'])
  np.testing.assert_array_equal(params['head']['bias'], -10.0)
  assert abs(float(jnp.std(params['Transformer']['posembed_input']['pos_embedding']))
             - 0.02) < 0.004


def test_gap_classifier_has_no_class_token():
  model = models.get_model('ViT-Ti_16', num_classes=3, num_layers=1, classifier='gap')
  params = model.init(jax.random.PRNGKey(0), _images(), train=False)['params']
  assert 'cls' not in params
  assert params['Transformer']['posembed_input']['pos_embedding'].shape == (1, 4, 192)


def test_dropout_only_when_training():
  x = _images()
  drop = models.get_model('ViT-Ti_16', num_classes=4, num_layers=2, dropout_rate=0.2,
                          attention_dropout_rate=0.2)
  plain = models.get_model('ViT-Ti_16', num_classes=4, num_layers=2)
  params = drop.init(jax.random.PRNGKey(0), x, train=False)['params']
  params['head']['kernel'] = jax.random.normal(jax.random.PRNGKey(1),
                                               params['head']['kernel'].shape)
  evaluated = drop.apply({'params': params}, x, train=False)
  np.testing.assert_array_equal(evaluated, plain.apply({'params': params}, x, train=False))
  rngs = lambda s: {'dropout': jax.random.PRNGKey(s)}
  trained = drop.apply({'params': params}, x, train=True, rngs=rngs(1))
  assert not np.allclose(trained, evaluated, atol=1e-3)
  np.testing.assert_array_equal(trained, drop.apply({'params': params}, x, train=True,
                                                    rngs=rngs(1)))
  assert not np.allclose(trained, drop.apply({'params': params}, x, train=True, rngs=rngs(2)))


@pytest.mark.parametrize('family', ['vit', 'hybrid', 'bit'])
def test_bfloat16_compute_keeps_float32_params(family):
  name, overrides, size = FAMILIES[family]
  x = _images(size=size)
  m32 = models.get_model(name, num_classes=3, **overrides)
  m16 = models.get_model(name, num_classes=3, dtype='bfloat16', **overrides)
  params = m16.init(jax.random.PRNGKey(0), x, train=False)['params']
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  params['head']['kernel'] = jax.random.normal(jax.random.PRNGKey(1),
                                               params['head']['kernel'].shape)
  y32 = m32.apply({'params': params}, x, train=False)
  y16 = m16.apply({'params': params}, x, train=False)
  assert y16.dtype == jnp.float32
  scale = float(jnp.abs(y32).max())
  assert float(jnp.abs(y16 - y32).max()) < 0.05 * scale
  assert float(jnp.abs(y16 - y32).max()) > 0  # bf16 really ran


# Smaller still: the gradient of each is compiled twice.
REMAT_CASES = {
    'vit': ('ViT-Ti_16', dict(num_layers=2, patch_size=8, dropout_rate=0.1), 32),
    'hybrid': ('R26+ViT-S_32',
               dict(num_layers=1, resnet_layers=(1,), hidden_size=64, mlp_dim=64, num_heads=2), 32),
    'bit': ('BiT-M-R50x1', dict(resnet_layers=(1,)), 32),
}


def _square_loss(p, m, x):
  y = m.apply({'params': p}, x, train=True, rngs={'dropout': jax.random.PRNGKey(3)})
  return jnp.sum(y**2)


def _assert_same_gradients(plain, remat, params, x):
  g1 = jax.grad(_square_loss)(params, plain, x)
  g2 = jax.grad(_square_loss)(params, remat, x)
  # Recomputation may reassociate float sums: compare relative to the gradients' scale.
  scale = max(float(jnp.abs(a).max()) for a in jax.tree.leaves(g1))
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize('family', sorted(REMAT_CASES))
def test_remat_gives_same_values_and_gradients(family):
  name, overrides, size = REMAT_CASES[family]
  x = _images(size=size)
  plain = models.get_model(name, num_classes=3, **overrides)
  remat = plain.clone(remat=True)
  params = plain.init(jax.random.PRNGKey(0), x, train=False)['params']
  params['head']['kernel'] = jax.random.normal(jax.random.PRNGKey(1),
                                               params['head']['kernel'].shape)
  assert jax.tree.structure(params) == jax.tree.structure(
      remat.init(jax.random.PRNGKey(0), x, train=False)['params'])

  _assert_same_gradients(plain, remat, params, x)


def test_unknown_name_lists_known_names():
  with pytest.raises(ValueError,
                     match=r"^Unknown model 'vit-b16' \(did you mean ViT-B_16\?\); known: "):
    models.get_model('vit-b16', num_classes=3)
  with pytest.raises(ValueError, match=r"Unknown model 'ViT-X_16'.*ViT-B_16"):
    models.get_model('ViT-X_16', num_classes=10)


def test_unknown_field_lists_fields():
  with pytest.raises(ValueError, match=r'Unknown field\(s\) dropout_rate.*resnet_width'):
    models.get_model('R50x1', num_classes=10, dropout_rate=0.1)
  with pytest.raises(ValueError, match='classifier'):
    models.get_model('ViT-B_16', num_classes=10, classifier='mean')
  with pytest.raises(ValueError, match='dtype'):
    models.get_model('ViT-B_16', num_classes=10, dtype='float8')


def test_image_size_not_divisible_names_the_fix():
  model = models.get_model('ViT-Ti_16', num_classes=10, num_layers=1)
  with pytest.raises(ValueError, match='divisible by 16'):
    model.init(jax.random.PRNGKey(0), jnp.zeros((1, 40, 40, 3)), train=False)


def test_hybrid_grid_is_one_sixteenth_of_the_image():
  model = models.get_model('R50+ViT-B_16', num_classes=10)
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros(
      (1, 384, 384, 3)), train=False))
  assert shapes['params']['Transformer']['posembed_input']['pos_embedding'].shape == (1, 577, 768)
  assert shapes['params']['embedding']['kernel'].shape == (1, 1, 1024, 768)


@pytest.mark.parametrize('strides,padding,size', [((1, 1), 'SAME', 9), ((2, 2), 'SAME', 9),
                                                  ((2, 2), 'SAME', 8), ((2, 2), 'VALID', 7)])
def test_1x1_std_conv_as_matmul_equals_the_convolution(strides, padding, size):
  # 1x1 kernels run as a dot over channels (faster gradients on CPU): same values and
  # gradients as the convolution they replace, odd maps and strides included.
  conv = resnet.StdConv(6, (1, 1), strides, padding)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, size, size, 5))
  params = conv.init(jax.random.PRNGKey(1), x)['params']

  def reference(p, x):
    w = p['kernel'] - jnp.mean(p['kernel'], axis=(0, 1, 2), keepdims=True)
    w = w / (jnp.sqrt(jnp.mean(jnp.square(w), axis=(0, 1, 2), keepdims=True)) + 1e-5)
    return jax.lax.conv_general_dilated(x, w, strides, padding,
                                        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))

  ours = lambda p, x: conv.apply({'params': p}, x)
  np.testing.assert_allclose(ours(params, x), reference(params, x), rtol=1e-5, atol=1e-5)
  loss = lambda f: lambda p, x: jnp.sum(jnp.sin(f(p, x)))
  g_ours = jax.grad(loss(ours), (0, 1))(params, x)
  g_ref = jax.grad(loss(reference), (0, 1))(params, x)
  for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _bf16_exact(key, shape):
  """Random values that bfloat16 holds exactly: a dot of them has no input rounding."""
  return jax.random.normal(key, shape).astype(jnp.bfloat16).astype(jnp.float32)


def test_bf16_dot_accumulates_in_float32_forward_and_backward():
  # K = 4096 products of bf16-exact operands: float32 accumulation matches the float64
  # reference to ~1e-6 relative; a bf16 result (or bf16 gradients) would be off by ~1e-3.
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  a = _bf16_exact(k1, (2, 16, 4096))
  w = _bf16_exact(k2, (4096, 8))
  ct = _bf16_exact(k3, (2, 16, 8))
  dims = (((2,), (0,)), ((), ()))
  out, vjp = jax.vjp(lambda a, w: precision.dot_general(a, w, dims), a, w)
  da, dw = vjp(ct)
  a64, w64, ct64 = (np.asarray(v, np.float64) for v in (a, w, ct))
  refs = {'out': a64 @ w64, 'da': ct64 @ w64.T, 'dw': np.einsum('bnk,bnf->kf', a64, ct64)}
  for name, got in {'out': out, 'da': da, 'dw': dw}.items():
    assert got.dtype == jnp.float32, name
    ref = refs[name]
    err = float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))
    assert err < 1e-5, (name, err)


@pytest.mark.parametrize(
    'dims,shapes',
    [
        ((((3,), (3,)), ((0, 2), (0, 2))), ((2, 5, 3, 4), (2, 6, 3, 4))),  # attention logits
        ((((3,), (1,)), ((0, 1), (0, 2))), ((2, 3, 5, 6), (2, 6, 3, 4))),  # weights . values
        ((((1, 2), (0, 1)), ((), ())), ((7, 3, 4), (3, 4, 5))),  # attention out projection
        ((((0,), (0,)), ((), ())), ((7, 5), (7, 3))),
        # Weight gradients taken as (g^T lhs)^T (lhs much larger than g): a dense layer,
        # one over two axes, and one whose kernel lists those axes in the other order.
        ((((2,), (0,)), ((), ())), ((4, 16, 16), (16, 2))),
        ((((1, 2), (0, 1)), ((), ())), ((64, 3, 4), (3, 4, 2))),
        ((((1, 2), (1, 0)), ((), ())), ((64, 3, 4), (4, 3, 2))),
    ])
@pytest.mark.parametrize('dot_general', [precision.dot_general, precision.float32_dot_general])
def test_ordered_dot_gradients_equal_lax_dot_general(dims, shapes, dot_general):
  # Small integers are exact in bf16 and their sums in f32: the gradients must be equal.
  rng = np.random.default_rng(0)
  a, b = (jnp.asarray(rng.integers(-3, 4, s), jnp.float32) for s in shapes)
  ref_out, ref_vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims), a, b)
  out, vjp = jax.vjp(lambda a, b: dot_general(a, b, dims), a, b)
  ct = jnp.asarray(rng.integers(-3, 4, out.shape), jnp.float32)
  np.testing.assert_array_equal(out, ref_out)
  for got, ref in zip(vjp(ct), ref_vjp(ct)):
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize(
    'dot_general,shapes,transposes_cotangent',
    [
        # ViT-Ti/16's MLP output layer, scaled down: g is small.
        (precision.dot_general, ((64, 16), (16, 2)), True),
        (precision.float32_dot_general, ((64, 16), (16, 2)), True),
        # Its input layer: lhs is the small one.
        (precision.dot_general, ((64, 2), (2, 16)), False),
        (precision.float32_dot_general, ((64, 2), (2, 16)), False),
        # ViT-B/16's MLP output layer, scaled down: the f32 result's transpose costs more
        # than a bf16 lhs's, less than a float32 lhs's.
        (precision.dot_general, ((16, 32), (32, 8)), False),
        (precision.float32_dot_general, ((16, 32), (32, 8)), True),
    ])
def test_weight_gradient_transposes_the_smaller_operand(dot_general, shapes, transposes_cotangent):
  # The (g^T lhs)^T order is marked by the barrier that keeps XLA from undoing it.
  a, w = (jnp.ones(s, jnp.float32) for s in shapes)
  dims = (((1,), (0,)), ((), ()))
  grads = jax.grad(lambda a, w: jnp.sum(dot_general(a, w, dims)), (0, 1))
  jaxpr = str(jax.make_jaxpr(grads)(a, w))
  assert ('optimization_barrier' in jaxpr) == transposes_cotangent, jaxpr


@pytest.mark.parametrize(
    'name,overrides',
    [
        ('ViT-Ti_16', dict(num_layers=2)),
        # 1x1 convolutions are dots too (resnet.StdConv): 256 -> 128 channels at 16x16.
        ('R+ViT-Ti_16', dict(num_layers=1, resnet_layers=(1, 1))),
    ])
def test_float32_models_on_cpu_use_the_ordered_dots_with_flax_gradients(
    monkeypatch, name, overrides):
  # Same forward, gradients equal to lax's own dots' but for float32 summation order.
  assert precision.dense_options('float32') == {'dot_general': precision.float32_dot_general}
  model = models.get_model(name, num_classes=3, **overrides)
  x = _images(n=16, size=64)  # 272 ViT-Ti tokens: enough for the MLP output layer's order
  params = model.init(jax.random.PRNGKey(0), x, train=False)['params']
  params['head']['kernel'] = 0.1 * jax.random.normal(jax.random.PRNGKey(1),
                                                     params['head']['kernel'].shape)
  loss = lambda p: jnp.sum(jnp.sin(model.apply({'params': p}, x, train=False)))
  # Jitted, as the train step runs: op by op, the hybrid's case took 83 CPU s instead of 61.
  ours = jax.jit(jax.value_and_grad(loss))(params)
  assert 'optimization_barrier' in str(jax.make_jaxpr(jax.grad(loss))(params))  # (g^T x)^T
  monkeypatch.setattr(precision, 'dot_general_for', lambda dtype: None)
  reference = jax.jit(jax.value_and_grad(loss))(params)
  assert 'optimization_barrier' not in str(jax.make_jaxpr(jax.grad(loss))(params))
  np.testing.assert_allclose(ours[0], reference[0], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(reference[1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _dot_generals(jaxpr):
  """Every dot_general equation of a (closed) jaxpr, nested jaxprs included."""
  yield from (eqn for eqn in jaxpr.eqns if eqn.primitive.name == 'dot_general')
  for sub in jax.extend.core.subjaxprs(jaxpr):
    yield from _dot_generals(sub)


@pytest.mark.parametrize('capability', [0.0, 7.5, 9.0], ids=['not_nvidia', 't4', 'h100'])
@pytest.mark.parametrize('family', ['vit', 'hybrid', 'bit'])
def test_bf16_model_every_dot_is_bf16_with_float32_accumulation(family, capability, monkeypatch):
  # Forward and backward: bf16 operands; float32 results (precision.py's dots), except on an
  # NVIDIA GPU with bf16 tensor cores, where the layers' dots are XLA's own (float32
  # accumulation in cuBLAS and Triton) with bf16 results (precision.is_mixed); there the
  # attention is cuDNN's fused one (the paper's head sizes), whose stand-in here is not.
  monkeypatch.setattr(accelerator, 'cuda_capability', lambda: capability)
  monkeypatch.setattr(attention, 'fuses', lambda dtype, head_dim: False)  # cuDNN needs a GPU
  bf16_results = capability >= 8.0
  name, overrides, size = FAMILIES[family]
  x = _images(size=size)
  model = models.get_model(name, num_classes=3, dtype='bfloat16', **overrides)
  params = model.init(jax.random.PRNGKey(0), x, train=False)['params']
  loss = lambda p: jnp.sum(model.apply({'params': p}, x, train=False)**2)
  eqns = list(_dot_generals(jax.make_jaxpr(jax.grad(loss))(params).jaxpr))
  assert len(eqns) >= 3
  for eqn in eqns:
    if bf16_results and eqn.params['dimension_numbers'][1][0]:
      continue  # the unfused attention's: autodiff's, around float32 logits
    assert [v.aval.dtype for v in eqn.invars] == [jnp.bfloat16] * 2, eqn
    assert eqn.outvars[0].aval.dtype == (jnp.bfloat16 if bf16_results else jnp.float32), eqn


@pytest.mark.parametrize('family', ['vit', 'hybrid'])
def test_a_bf16_model_with_bf16_result_dots_computes_the_same(family, monkeypatch):
  # As a bf16 model runs on an NVIDIA GPU (XLA's own dots, bf16 results; precision.is_mixed):
  # against the float32 model at full matmul precision, its logits and gradients are about as
  # close as those of precision.py's float32-result dots.
  monkeypatch.setattr(attention, 'fuses', lambda dtype, head_dim: False)  # cuDNN needs a GPU
  name, overrides, size = REMAT_CASES[family]
  x = _images(size=size)
  model = lambda dtype: models.get_model(name, num_classes=5, dtype=dtype, **overrides)
  params = model('float32').init(jax.random.PRNGKey(0), x, train=False)['params']
  params['head']['kernel'] = jax.random.normal(jax.random.PRNGKey(1),
                                               params['head']['kernel'].shape)
  weights = jax.random.normal(jax.random.PRNGKey(3), (x.shape[0], 5))

  def logits_and_grads(dtype):
    apply = lambda p: model(dtype).apply({'params': p}, x, train=False).astype(jnp.float32)
    flat = lambda tree: jnp.concatenate([jnp.ravel(g) for g in jax.tree.leaves(tree)])
    # A linear loss: its cotangent is exact, so the errors are the model's own.
    return jax.jit(lambda p: (apply(p), flat(jax.grad(lambda q: jnp.sum(apply(q) * weights))(p))))(
        params)

  with jax.default_matmul_precision('highest'):
    reference = logits_and_grads('float32')
  monkeypatch.setattr(accelerator, 'cuda_capability', lambda: 0.0)
  f32_results = logits_and_grads('bfloat16')
  monkeypatch.setattr(accelerator, 'cuda_capability', lambda: 9.0)
  assert not precision.is_mixed('bfloat16')
  bf16_results = logits_and_grads('bfloat16')
  for what, ours, theirs, exact in zip(('logits', 'gradients'), bf16_results, f32_results,
                                       reference):
    error = lambda y, exact=exact: float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact))
    assert 0 < error(ours) < 0.1, (what, error(ours))  # bf16 roundings, not a wrong model
    assert error(ours) < 1.5 * error(theirs) + 1e-3, (what, error(ours), error(theirs))


@pytest.mark.parametrize('barriers_kept', [False, True], ids=['xla_cpu', 'tpu_gpu'])
@pytest.mark.parametrize(
    'policy',
    ['', 'nothing_saveable', 'dots_saveable', 'dots_with_no_batch_dims_saveable', True, False])
def test_remat_policies_give_the_gradients_of_no_remat(policy, barriers_kept, monkeypatch):
  # tpu_gpu: plain jax.checkpoint, as on backends that keep its barriers; xla_cpu adds the
  # dependency on the cotangent (models/remat.py).
  monkeypatch.setattr(remat_lib, 'compiler_drops_barriers', lambda: not barriers_kept)
  name, overrides, size = REMAT_CASES['vit']
  x = _images(size=size)
  plain = models.get_model(name, num_classes=3, **overrides)
  remat = models.get_model(name, num_classes=3, remat=policy, **overrides)
  params = plain.init(jax.random.PRNGKey(0), x, train=False)['params']
  params['head']['kernel'] = jax.random.normal(jax.random.PRNGKey(1),
                                               params['head']['kernel'].shape)

  _assert_same_gradients(plain, remat, params, x)
  # The policy is really applied: remat shows in the gradient's jaxpr unless off.
  text = str(jax.make_jaxpr(jax.grad(_square_loss), static_argnums=1)(params, remat, x))
  assert ('checkpoint' in text or 'remat' in text) == bool(remat_lib.block_policy(policy))


def _mlp_model(remat, dtype, dropout_rate=0.0):
  # ViT-Ti/16 with 16 tokens and a 48-wide MLP: its hidden layer is (batch, 17, 48).
  return models.get_model('ViT-Ti_16', num_classes=3, num_layers=2, patch_size=8, mlp_dim=48,
                          dtype=dtype, remat=remat, dropout_rate=dropout_rate)


def _mlp_params(model, x):
  params = model.init(jax.random.PRNGKey(0), x, train=False)['params']
  params['head']['kernel'] = jax.random.normal(jax.random.PRNGKey(1),
                                               params['head']['kernel'].shape)  # not zeros
  return params


@pytest.mark.parametrize('dots', ['precision', 'flax'])
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_remat_gelu_gives_the_gradients_of_no_remat_and_keeps_the_mlps_hidden_layer_once(
    dtype, dots, capsys, monkeypatch):
  if dots == 'flax':  # as on a GPU: flax's own dots (lax.dot_general) in both dtypes
    monkeypatch.setattr(precision, 'dot_general_for', lambda dtype: None)
    monkeypatch.setattr(precision, 'is_mixed', lambda dtype: False)
  x = _images(size=32)
  plain, gelu = _mlp_model('', dtype), _mlp_model('gelu', dtype)
  params = _mlp_params(plain, x)
  loss = lambda p, m: jnp.sum(m.apply({'params': p}, x, train=True).astype(jnp.float32)**2)
  for a, b in zip(jax.tree.leaves(jax.grad(loss)(params, plain)),
                  jax.tree.leaves(jax.grad(loss)(params, gelu))):
    np.testing.assert_array_equal(a, b)  # the same dots, in the same order
  # Without remat each block keeps the hidden layer twice: GELU's input and its output (the
  # second layer's input); under 'gelu' once.
  for model, kept in ((plain, 4), (gelu, 2)):
    jax.ad_checkpoint.print_saved_residuals(lambda p, model=model: loss(p, model), params)
    out = capsys.readouterr().out
    assert len(re.findall(r'\[2,17,48\]', out)) == kept, out


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_remat_gelu_plans_less_memory_on_xla_cpu(dtype):
  # ViT-Ti/16 with 4 blocks of 65 tokens, batch 8: 25.4 against 20.6 MB in float32 (with
  # YNNPACK's fusions), 15.4 against 13.0 in bf16. Without the recomputation's dependence on
  # the cotangent XLA merges it with the forward pass's GELU and keeps that alive. float32
  # with YNNPACK's fusions off (the suite's flags for float32 on some hosts) plans the same
  # either way: 27.4 MB.
  if jax.default_backend() != 'cpu':
    pytest.skip('measured on XLA:CPU')
  off, gelu = _planned_temporaries_mb('', dtype), _planned_temporaries_mb('gelu', dtype)
  if dtype == 'float32' and not xla_cpu_flags.ynnpack_fusions_on():
    assert gelu <= off
  else:
    assert gelu < 0.9 * off


def test_remat_gelu_under_dropout_is_the_model_without_remat():
  x = _images(size=32)
  plain, gelu = _mlp_model('', 'float32', 0.1), _mlp_model('gelu', 'float32', 0.1)
  params = _mlp_params(plain, x)
  for a, b in zip(jax.tree.leaves(jax.grad(_square_loss)(params, plain, x)),
                  jax.tree.leaves(jax.grad(_square_loss)(params, gelu, x))):
    np.testing.assert_array_equal(a, b)
  assert 'dropout_rate 0.1' in remat_lib.gelu_remat_note('gelu', 0.1)
  assert 'no MLP' in remat_lib.gelu_remat_note('gelu', None)
  assert remat_lib.gelu_remat_note('gelu', 0.0) is None
  assert remat_lib.gelu_remat_note('', 0.1) is None


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('policy,batched,saved', [
    ('nothing_saveable', False, False),
    ('dots_saveable', False, True),
    ('dots_saveable', True, True),
    ('dots_with_no_batch_dims_saveable', False, True),
    ('dots_with_no_batch_dims_saveable', True, False),
])
def test_dot_policies_keep_the_models_own_dots(dtype, policy, batched, saved, capsys):
  # jax's dot policies alone see precision.py's custom-VJP dots as no dots and recompute
  # them (the float32 ViT-Ti/16 step under dots_with_no_batch_dims_saveable: 0.81x). A
  # float32 dot keeps its result; a bf16 model's layer keeps its output, rounded to bf16
  # (`precision.layer_output`), not the dot's float32 result; a batched dot keeps its result.
  dot_general = precision.dot_general_for(dtype) or precision.float32_dot_general
  dims = (((2,), (1,)), ((0,), (0,))) if batched else (((2,), (0,)), ((), ()))
  x, w = jnp.ones((2, 8, 4)), jnp.ones((2, 4, 3) if batched else (4, 3))

  def layer(x, w):
    y = dot_general(x, w, dims)
    return y if batched else precision.layer_output(y, dtype)

  f = lambda x, w: jnp.sum(jnp.sin(layer(x, w).astype(jnp.float32)))
  jax.ad_checkpoint.print_saved_residuals(
      jax.checkpoint(f, policy=remat_lib.checkpoint_policy(policy)), x, w)
  out = capsys.readouterr().out
  # jax prints f32[...] or float32[...], by version.
  shows = lambda short, long: f'{short}[2,8,3]' in out or f'{long}[2,8,3]' in out
  float32_kept, bf16_kept = shows('f32', 'float32'), shows('bf16', 'bfloat16')
  if batched or dtype == 'float32':
    assert (float32_kept, bf16_kept) == (saved, False), out
  else:
    assert (float32_kept, bf16_kept) == (False, saved), out


def test_a_bf16_block_under_a_dots_policy_keeps_bf16_layer_outputs(capsys):
  # ViT-Ti/16 with 16 tokens and a 48-wide MLP: the MLP's hidden layer, (2, 17, 48), is
  # kept once, in bf16 (GELU's input); before, its dot's float32 result was kept (twice the
  # bytes: ViT-Ti/16 b32 bf16 peak RSS 1.16 GiB, 0.97 with bf16, benchmarks/README.md).
  model = models.get_model('ViT-Ti_16', num_classes=3, num_layers=1, patch_size=8, mlp_dim=48,
                           dtype='bfloat16', remat='dots_with_no_batch_dims_saveable')
  x = _images(size=32)
  params = model.init(jax.random.PRNGKey(0), x, train=False)['params']
  jax.ad_checkpoint.print_saved_residuals(
      lambda p: jnp.sum(model.apply({'params': p}, x, train=False)), params)
  out = capsys.readouterr().out
  assert re.search(r'(bf16|bfloat16)\[2,17,48\]', out), out
  assert not re.search(r'(f32|float32)\[2,17,48\]', out), out


def _planned_temporaries_mb(policy, dtype='float32'):
  model = models.get_model('ViT-Ti_16', num_classes=3, num_layers=4, patch_size=8, remat=policy,
                           dtype=dtype)
  x = jnp.ones((8, 64, 64, 3))
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x[:1], train=False))
  loss = lambda p, x: jnp.sum(model.apply(p, x, train=False)**2)
  step = jax.jit(jax.grad(loss), compiler_options=remat_lib.step_compiler_options(policy))
  return step.lower(params, x).compile().memory_analysis().temp_size_in_bytes / 1e6


def test_remat_keeps_less_for_the_backward_pass_on_xla_cpu():
  # The suite runs under vit_jax's XLA:CPU flags, so no remat plans 37 MB here under the
  # memory-optimised scheduler. Before the cotangent dependency and the default scheduler
  # for remat'd steps (models/remat.py), every policy planned about as much as no remat
  # (41.5 vs 41.9 MB under the default scheduler, 38.8 vs 35.6 under the memory-optimised
  # one); with them nothing_saveable plans 15 MB, the dots policies 20-22 MB.
  assert remat_lib.compiler_drops_barriers()
  off = _planned_temporaries_mb('')
  assert _planned_temporaries_mb('nothing_saveable') < 0.5 * off
  for policy in ('dots_saveable', 'dots_with_no_batch_dims_saveable'):
    assert _planned_temporaries_mb(policy) < 0.75 * off, policy


def test_weight_gradients_run_when_their_cotangent_is_ready(monkeypatch):
  # Without the dependence of each layer's input gradient on its weight gradient
  # (precision.dot_gradients), XLA:CPU's memory-optimised scheduler runs every
  # weight-gradient dot at the end of the backward pass, keeping the operands of all of
  # them alive until then.
  if jax.default_backend() != 'cpu':
    pytest.skip('a rule of the CPU backend')
  shipped = _planned_temporaries_mb('', 'bfloat16')
  monkeypatch.setattr(precision, 'after_weight_gradient', lambda d_lhs, d_rhs: d_lhs)
  assert shipped < 0.95 * _planned_temporaries_mb('', 'bfloat16')


def test_bf16_kernels_are_converted_again_for_the_backward_pass(monkeypatch):
  # XLA merges the backward pass's bf16 copy of each float32 kernel with the forward pass's
  # and keeps them all alive in between, unless the backward's is made after the cotangent
  # (precision.kernel_for_backward). The gradients are the same.
  if jax.default_backend() != 'cpu':
    pytest.skip('a rule of the CPU backend')
  model = models.get_model('ViT-Ti_16', num_classes=3, num_layers=4, patch_size=8, hidden_size=256,
                           num_heads=4, mlp_dim=2048, dtype='bfloat16')
  x = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)), jnp.float32)
  params = jax.jit(lambda rng: model.init(rng, x[:1], train=False))(jax.random.PRNGKey(0))
  loss = lambda p, x: jnp.sum(model.apply(p, x, train=False).astype(jnp.float32)**2)
  step = lambda: jax.jit(jax.grad(loss)).lower(params, x).compile()
  recast = step()
  monkeypatch.setattr(precision, 'kernel_for_backward',
                      lambda kernel, g, input_size, compute_dtype: kernel)
  kept = step()
  planned = lambda s: s.memory_analysis().temp_size_in_bytes
  # Under the suite's flags: 2.6 vs 4.6 MB.
  assert planned(recast) < 0.75 * planned(kept), (planned(recast), planned(kept))
  for a, b in zip(jax.tree.leaves(recast(params, x)), jax.tree.leaves(kept(params, x))):
    np.testing.assert_array_equal(a, b)


def test_small_bf16_kernels_keep_the_forward_pass_copy():
  # Kernels with under a quarter as many elements as their layer's input (here 2056 tokens
  # of 64 channels, the MLP's kernels 64x128 and 128x64) keep the forward pass's copy: no
  # kernel of theirs is made to depend on a cotangent (the head's 64x3 kernel is).
  if jax.default_backend() != 'cpu':
    pytest.skip('a rule of the CPU backend')
  model = models.get_model('ViT-Ti_16', num_classes=3, num_layers=1, patch_size=2, hidden_size=64,
                           num_heads=2, mlp_dim=128, dtype='bfloat16')
  x = jnp.zeros((8, 32, 32, 3))
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x[:1], train=False))
  loss = lambda p, x: jnp.sum(model.apply(p, x, train=False).astype(jnp.float32)**2)
  program = jax.jit(jax.grad(loss)).lower(params, x).as_text()
  kernel_adds = lambda shape: re.findall(rf'stablehlo\.add .*: tensor<{shape}xf32>$', program, re.M)
  assert kernel_adds('64x3'), 'the head is recast'
  assert not kernel_adds('64x128') and not kernel_adds('128x64')


def _resnet_step(model, params, x):
  """The compiled gradient step of a model."""
  loss = lambda p, x: jnp.sum(model.apply(p, x, train=False).astype(jnp.float32)**2)
  return jax.jit(jax.grad(loss)).lower(params, x).compile()


def test_block_parameter_gradients_run_before_its_input_gradient(monkeypatch):
  # Without the dependence of each block's input gradient on all its parameter gradients
  # (remat.inputs_after), XLA:CPU's memory-optimised scheduler runs the gradients that only
  # the optimizer reads, the biases', LayerNorms' and GroupNorms' sums over the batch, at
  # the end of the backward pass, keeping every block's cotangents alive until then
  # (R50+ViT-B/16 b8 bf16: 2.28 GiB planned, 2.04 with it). The gradients are the same.
  # (The suite's flags are float32's, YNNPACK fusions off, under which small hybrids show
  # less of it than a bf16 run does.)
  if jax.default_backend() != 'cpu':
    pytest.skip('a rule of the CPU backend')
  assert remat_lib.parameter_gradients_first('bfloat16')
  assert not remat_lib.parameter_gradients_first('float32')  # the suite's: YNNPACK off
  model = models.get_model('BiT-S-R50x1', num_classes=3, dtype='bfloat16')
  x = _images(n=2, size=64)
  # One init for both steps, jitted: op by op, BiT-S-R50x1's took 42 s instead of 18.
  params = jax.jit(lambda rng: model.init(rng, x, train=False))(jax.random.PRNGKey(0))
  tied = _resnet_step(model, params, x)
  monkeypatch.setattr(remat_lib, 'inputs_after',
                      lambda inputs_t, params_t, vectors_only=False: inputs_t)
  untied = _resnet_step(model, params, x)
  # Under the suite's flags: 44.7 vs 68.9 MB.
  planned = lambda step: step.memory_analysis().temp_size_in_bytes
  assert planned(tied) < 0.8 * planned(untied), (planned(tied), planned(untied))
  for a, b in zip(jax.tree.leaves(tied(params, x)), jax.tree.leaves(untied(params, x))):
    np.testing.assert_array_equal(a, b)


def test_float32_blocks_compute_their_sums_over_the_batch_first_where_ynnpack_runs(monkeypatch):
  # float32 ran 0.90-0.97x with the dependence under XLA:CPU's YNNPACK fusions off, and
  # 0.96-1.03x with them on, planning less (ViT-B/16 b8 1.75 -> 1.65 GiB). Only the 1-D
  # leaves tie (each block's LayerNorms' and its MLP's and output projection's biases: 7
  # of 16): tying the kernels and the 2-D q, k, v biases too planned more (ViT-Ti/16 b32
  # 1.07 instead of 1.05 GiB). A bf16 model ties all 16 (as fast or faster, same memory).
  if jax.default_backend() != 'cpu':
    pytest.skip('a rule of the CPU backend')
  ynnpack_off = xla_cpu_flags.YNNPACK_OFF
  monkeypatch.setenv('XLA_FLAGS', f'--xla_force_host_platform_device_count=8 {ynnpack_off}')
  assert not remat_lib.parameter_gradients_first('float32')
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
  assert remat_lib.parameter_gradients_first('float32')
  model = models.get_model('ViT-Ti_16', num_classes=3, num_layers=2, patch_size=8)
  x = _images(n=2, size=32)
  params = jax.jit(lambda rng: model.init(rng, x, train=False))(jax.random.PRNGKey(0))
  loss = lambda p, x: jnp.sum(model.apply(p, x, train=False)**2)
  program = jax.jit(jax.grad(loss)).lower(params, x).as_text()
  # One concatenation of the tying elements per block.
  ties = lambda program, n: re.findall(rf'stablehlo\.concatenate .*-> tensor<{n}xf32>$', program, re
                                       .M)
  assert len(ties(program, 7)) == 2 and not ties(program, 16)
  tied = jax.jit(jax.grad(loss))(params, x)
  monkeypatch.setenv('XLA_FLAGS', f'--xla_force_host_platform_device_count=8 {ynnpack_off}')
  model = models.get_model('ViT-Ti_16', num_classes=3, num_layers=2, patch_size=8)
  untied = jax.jit(jax.grad(loss))(params, x)
  assert not ties(jax.jit(jax.grad(loss)).lower(params, x).as_text(), 7)
  for a, b in zip(jax.tree.leaves(tied), jax.tree.leaves(untied)):
    np.testing.assert_array_equal(a, b)
  model = models.get_model('ViT-Ti_16', num_classes=3, num_layers=2, patch_size=8, dtype='bfloat16')
  loss16 = lambda p, x: jnp.sum(model.apply(p, x, train=False).astype(jnp.float32)**2)
  program = jax.jit(jax.grad(loss16)).lower(params, x).as_text()
  assert len(ties(program, 16)) == 2


def test_unknown_remat_policy_names_the_choices():
  with pytest.raises(
      ValueError, match=r"remat 'dots' is unknown: set --config.remat to one of "
      r"'' \(off\), nothing_saveable, dots_saveable"):
    models.get_model('ViT-Ti_16', num_classes=3, remat='dots')


@pytest.mark.parametrize('name', ['ViT-Ti_16', 'R50x1'])
@pytest.mark.parametrize('shape,message', [
    ((2, 3, 32, 32), r'^images of shape \(2, 3, 32, 32\) look channels-first \(NCHW\): the models '
     r'take NHWC, images\.transpose\(0, 2, 3, 1\)'),
    ((32, 32, 3), r'^images of shape \(32, 32, 3\): expected a batch \[n, height, width, '
     r'channels\] \(one image: images\[None\]\)'),
])
def test_images_in_another_layout_are_named(name, shape, message):
  """PyTorch's NCHW or a single image had been refused as "Feature map 3x32 is not divisible
  by patch size 16: use an image size divisible by 16" (ViT)."""
  model = models.get_model(name, num_classes=3, **({'num_layers': 1} if 'ViT' in name else {}))
  with pytest.raises(ValueError, match=message):
    model.init(jax.random.PRNGKey(0), jnp.zeros(shape), train=False)


@pytest.mark.parametrize('name', ['ViT-Ti_16', 'R50x1'])
@pytest.mark.parametrize('dtype', [np.uint8, np.int32, bool])
def test_integer_images_are_refused_with_the_scaling(name, dtype):
  """uint8 pixels in [0, 255] had been taken without a word (the models take [-1, 1])."""
  model = models.get_model(name, num_classes=3, **({'num_layers': 1} if 'ViT' in name else {}))
  with pytest.raises(
      ValueError, match=rf'^images of dtype {np.dtype(dtype)}: the models take '
      r'float images in \[-1, 1\] \(uint8 pixels: images / 127\.5 - 1\)'):
    model.init(jax.random.PRNGKey(0), np.zeros((1, 32, 32, 3), dtype), train=False)
  for ok in (jnp.bfloat16, np.float16):  # float images of any width pass
    model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3), ok), train=False)
