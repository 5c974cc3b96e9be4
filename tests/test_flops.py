"""Tests for vit_jax/flops.py: Table 6, hand-computed cases, XLA cross-checks."""
import jax
import jax.numpy as jnp
import pytest

from vit_jax import flops, models

# Table 6 (JFT-300M pre-training): model, epochs, exaFLOPs as printed in the paper.
TABLE6 = [
    ('ViT-B_32', 7, 55),
    ('ViT-B_16', 7, 224),
    ('ViT-L_32', 7, 196),
    ('ViT-L_16', 7, 783),
    ('ViT-L_16', 14, 1567),
    ('ViT-H_14', 14, 4262),
    ('R50x1', 7, 50),
    ('R50x2', 7, 199),
    ('R101x1', 7, 96),
    ('R152x1', 7, 141),
    ('R152x2', 7, 563),
    ('R152x2', 14, 1126),
    ('R200x3', 14, 3306),
    ('R50+ViT-B_32', 7, 106),
    ('R50+ViT-B_16', 7, 274),
    ('R50+ViT-L_32', 7, 246),
    ('R50+ViT-L_16', 7, 859),
    ('R50+ViT-L_16', 14, 1668),
]
# The one row no consistent count reaches: the paper's 7-epoch R50+ViT-L/16 (859) is
# 3% more than half its own 14-epoch figure (1668 / 2 = 834); every other 7/14-epoch
# pair in the table is exactly 1:2. Our count: 832.7 (-3.06%); the 14-epoch row: -0.15%.
_TOLERANCE = {('R50+ViT-L_16', 7): 0.035}


@pytest.mark.parametrize('name,epochs,exaflops', TABLE6)
def test_table6_pretraining_compute(name, epochs, exaflops):
  # JFT-300M defaults: 303M images, 18,291-way head; training = 3x forward.
  got = flops.pretraining_exaflops(name, epochs)
  assert got == pytest.approx(exaflops, rel=_TOLERANCE.get((name, epochs), 0.03))


def test_tiny_vit_by_hand():
  # 32px, 16px patches: 4 patches + class token = 5 tokens; D=8, MLP 16, 10 classes.
  kw = dict(num_layers=1, hidden_size=8, mlp_dim=16, num_heads=2)
  n, d, m = 5, 8, 16
  embed = 2 * 4 * (16 * 16 * 3) * d
  layer = 2 * n * d * d * 4 + 2 * 2 * n * n * d + 2 * 2 * n * d * m
  head = 2 * d * 10
  assert flops.forward_flops('ViT-Ti_16', 32, 10, **kw) == embed + layer + head
  # GAP (no class token, 4 tokens) with a 6-wide pre-logits layer and no head.
  n = 4
  layer = 2 * n * d * d * 4 + 2 * 2 * n * n * d + 2 * 2 * n * d * m
  assert flops.forward_flops('ViT-Ti_16', 32, 0, classifier='gap', representation_size=6,
                             **kw) == embed + layer + 2 * d * 6


def test_tiny_bit_by_hand():
  # One bottleneck unit (64 -> 64 -> 256, projected) on a 32px image, 10 classes.
  # Root 7x7/2 pad 3: 16x16 out; per axis the kernel offsets t=0..6 see 14, 15, 15, 16,
  # 16, 15, 15 real pixels = 106 taps (112 counting padding). Max-pool -> 8x8.
  # The 3x3 pad-1 conv on 8x8: 8 * 3 - 2 = 22 taps per axis (24 with padding).
  kw = dict(resnet_layers=(1,))
  conv1x1 = 2 * 64 * 64 * 64 + 2 * 64 * 64 * 256 * 2  # conv1, conv3, projection
  head = 2 * 256 * 10
  real = 2 * 106**2 * 3 * 64 + conv1x1 + 2 * 22**2 * 64 * 64 + head
  padded = 2 * 112**2 * 3 * 64 + conv1x1 + 2 * 24**2 * 64 * 64 + head
  assert flops.forward_flops('BiT-M-R50x1', 32, 10, **kw) == real
  assert flops.forward_flops('BiT-M-R50x1', 32, 10, count_padding=True, **kw) == padded


@pytest.mark.parametrize('size,k,stride,pads', [(8, 3, 1, 'SAME'), (9, 3, 2, 'SAME'),
                                                (11, 7, 2, 'SAME'), (10, 3, 2, 'SAME'),
                                                (17, 7, 2, (3, 3)), (13, 3, 2, (1, 1)),
                                                (15, 1, 2, (0, 0)), (12, 4, 4, (0, 0))])
def test_conv_count_is_xla_convention(size, k, stride, pads):
  # XLA's cost analysis skips kernel taps on zero padding; so do we (exactly).
  x, w = jnp.zeros((1, size, size, 3)), jnp.zeros((k, k, 3, 5))
  padding = pads if pads == 'SAME' else [pads, pads]
  conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (stride, stride), padding,
                                                   dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  got, out = flops._conv(size, k, stride, pads, 3, 5, count_padding=False)
  assert out == jax.eval_shape(conv, x, w).shape[1]
  assert got == flops.xla_flops(conv, x, w)


def _abstract_params(model, x):
  return jax.eval_shape(model.init, jax.random.key(0), x)['params']


@pytest.mark.parametrize('size', [64, 97, 100, 225])
def test_feature_map_matches_hybrid_model(size):
  # Tokens = (map side)^2 + class token: read them off the position embedding.
  kw = dict(resnet_layers=(1, 1, 1), num_layers=1, hidden_size=16, mlp_dim=16, num_heads=1)
  model = models.get_model('R50+ViT-B_16', 0, **kw)
  params = _abstract_params(model, jnp.zeros((1, size, size, 3)))
  side = flops.feature_map_size('R50+ViT-B_16', size, **kw)
  assert params['Transformer']['posembed_input']['pos_embedding'].shape[1] == side**2 + 1


@pytest.mark.parametrize('size', [64, 97, 224])
def test_feature_map_matches_bit_model(size):
  kw = dict(resnet_layers=(1, 1, 1, 1))
  model = models.get_model('BiT-M-R50x1', 0, **kw)
  x = jnp.zeros((1, size, size, 3))
  params = _abstract_params(model, x)
  _, state = jax.eval_shape(
      lambda p, x: model.apply({'params': p}, x, capture_intermediates=True, mutable=
                               ['intermediates']), params, x)
  shape = state['intermediates']['block4']['__call__'][0].shape
  assert shape[1] == shape[2] == flops.feature_map_size('BiT-M-R50x1', size, **kw)


def _analytic_over_xla(name, size, num_classes, **kw):
  model = models.get_model(name, num_classes, **kw)
  x = jnp.zeros((1, size, size, 3))
  params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _abstract_params(model, x))
  measured = flops.xla_flops(lambda p, x: model.apply({'params': p}, x), params, x)
  return flops.forward_flops(name, size, num_classes, **kw) / measured


# XLA also counts the elementwise work we leave out (norms, softmax, GELU/ReLU, adds,
# weight standardisation), so the analytic count is a little lower. Measured ratios:
# ViT-Ti/16 x2 layers 0.988; small hybrid 0.970; small BiT 0.965 (full BiT-R50x1: 0.974).
@pytest.mark.parametrize('name,size,num_classes,kw,low', [
    ('ViT-Ti_16', 224, 1000, dict(num_layers=2), 0.97),
    ('R50+ViT-B_16', 97, 10,
     dict(resnet_layers=(1, 1), num_layers=1, hidden_size=64, mlp_dim=128, num_heads=2), 0.94),
    ('BiT-M-R50x1', 97, 10, dict(resnet_layers=(1, 1, 1)), 0.94),
])
def test_analytic_vs_xla(name, size, num_classes, kw, low):
  assert low <= _analytic_over_xla(name, size, num_classes, **kw) <= 1.0


def test_masked_patch_call_vs_xla():
  """The masked patch objective's forward pass (its head on every patch token) as XLA
  counts it; the corruption's selects are elementwise. (kind and source are arguments: as
  constants XLA would fold the selects and drop the patch embedding.)"""
  kw = dict(num_layers=2)
  model = models.get_model('ViT-Ti_16', 0, **kw)
  x = jnp.zeros((1, 224, 224, 3))
  kind, source = jnp.ones((1, 196), jnp.int32), jnp.zeros((1, 196), jnp.int32)

  def apply(p, x, kind, source):
    return model.apply({'params': p}, x, corrupt=(kind, source), patch_outputs=512)

  abstract = jax.eval_shape(
      lambda x: model.init(jax.random.PRNGKey(0), x, corrupt=(kind, source), patch_outputs=512),
      x)['params']
  params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
  analytic = flops.forward_flops('ViT-Ti_16', 224, 0, patch_outputs=512, **kw)
  assert analytic == flops.forward_flops('ViT-Ti_16', 224, 0, **kw) + 196 * 2 * 192 * 512
  assert 0.97 <= analytic / flops.xla_flops(apply, params, x, kind, source) <= 1.0


def test_derived_quantities():
  fwd = flops.forward_flops('ViT-B_16')
  assert 35.1e9 < fwd < 35.2e9  # ~17.6 GMACs, as commonly quoted for ViT-B/16 at 224
  assert flops.train_flops('ViT-B_16') == 3 * fwd
  assert flops.train_step_flops('ViT-B_16', 256) == 256 * 3 * fwd
  assert flops.pretraining_exaflops('ViT-B_16', 1, num_images=10**6,
                                    num_classes=1000) == (pytest.approx(3 * fwd * 1e6 / 1e18))
  assert flops.mfu(2e12, 0.5, 8e12) == pytest.approx(0.5)
  with pytest.raises(ValueError, match='step_seconds'):
    flops.mfu(1.0, 0.0, 1.0)
  with pytest.raises(ValueError, match='not divisible by patch size 16'):
    flops.forward_flops('ViT-B_16', 230)
  with pytest.raises(ValueError, match='Unknown field'):
    flops.forward_flops('ViT-B_16', foo=1)


def test_xla_flops_accepts_list_form(monkeypatch):

  class Compiled:

    def cost_analysis(self):
      return [{'flops': 42.0}]

  class Lowered:

    def compile(self):
      return Compiled()

  monkeypatch.setattr(flops.jax, 'jit',
                      lambda fn: type('J', (), {'lower': lambda self, *a: Lowered()})())
  assert flops.xla_flops(lambda x: x, 1.0) == 42.0
