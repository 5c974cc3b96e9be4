"""Tests of vit_jax/optim.py: schedules, one optimiser step against numpy, validation."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from vit_jax import optim


def _config(**overrides):
  """The optimisation fields of configs/common.py, with overrides (kept local: no configs import)."""
  c = ml_collections.ConfigDict(
      dict(optimizer='adam', adam_b1=0.9, adam_b2=0.999, momentum=0.9, base_lr=0.1,
           lr_decay='linear', end_lr=0.0, warmup_steps=100, total_steps=1100, num_epochs=-1.0,
           num_train_examples=-1, batch_size=4096, accum_steps=1, weight_decay=0.0,
           grad_clip_norm=1.0, loss='softmax_xent', lr_grid=()))
  c.update(overrides)
  return c


# Schedules: warm-up 100 steps to 0.1, decay over the 1000 steps after it.
@pytest.mark.parametrize(
    'step,expected',
    [
        (0, 0.0),
        (50, 0.05),
        (100, 0.1),
        (600, 0.01 + 0.09 * 0.5),  # Half-way: end_lr + (base - end) / 2.
        (850, 0.01 + 0.09 * 0.25),
        (1100, 0.01),
        (2000, 0.01),  # Stays at end_lr past the end.
    ])
def test_linear_schedule(step, expected):
  schedule = optim.learning_rate_schedule(_config(end_lr=0.01), 1100)
  np.testing.assert_allclose(float(schedule(step)), expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    'step,expected',
    [
        (0, 0.0),
        (50, 0.05),
        (100, 0.1),
        (350, 0.05 * (1 + np.sqrt(0.5))),  # Quarter: 0.5 * base * (1 + cos(pi/4)).
        (600, 0.05),  # Half-way.
        (1100, 0.0),
        (1500, 0.0),
    ])
def test_cosine_schedule(step, expected):
  schedule = optim.learning_rate_schedule(_config(lr_decay='cosine'), 1100)
  np.testing.assert_allclose(float(schedule(step)), expected, rtol=1e-6, atol=1e-8)


def test_schedule_without_warmup_and_under_jit():
  schedule = jax.jit(optim.learning_rate_schedule(_config(warmup_steps=0), 1000))
  np.testing.assert_allclose(float(schedule(0)), 0.1, rtol=1e-6)
  np.testing.assert_allclose(float(schedule(jnp.int32(250))), 0.075, rtol=1e-6)


def test_total_steps():
  assert optim.total_steps(_config(total_steps=123), 10**9) == 123
  # Table 3, ViT-L/16 on JFT-300M for 7 epochs: 7 * 303e6 / 4096 = 517822.27 -> ceil.
  c = _config(total_steps=-1, num_epochs=7.0, num_train_examples=303_000_000)
  assert optim.total_steps(c) == 517_823
  # The config's count wins over the dataset's; the dataset's is the fallback.
  assert optim.total_steps(c, 1) == 517_823
  assert optim.total_steps(_config(total_steps=-1, num_epochs=2.0), 4096 * 5) == 10
  # Exact arithmetic: 0.1 * 40960 / 4096 is 1, though 0.1 * 40960 / 4096 > 1 in floats.
  assert optim.total_steps(_config(total_steps=-1, num_epochs=0.1), 40_960) == 1
  with pytest.raises(ValueError, match='num_train_examples'):
    optim.total_steps(_config(total_steps=-1, num_epochs=1.0))


# One step against numpy.
def _params():
  rng = np.random.RandomState(0)
  return {
      'Dense_0': {
          'kernel': rng.randn(3, 2).astype(np.float32),
          'bias': rng.randn(2).astype(np.float32)
      },
      'LayerNorm_0': {
          'scale': rng.randn(2).astype(np.float32),
          'bias': rng.randn(2).astype(np.float32)
      },
      'embedding': {
          'kernel': rng.randn(2, 2).astype(np.float32)
      },
      'pos_embedding': rng.randn(1, 2).astype(np.float32),
  }


def _grads(scale):
  rng = np.random.RandomState(1)
  return jax.tree.map(lambda p: (scale * rng.randn(*p.shape)).astype(np.float32), _params())


def _flat(tree):
  return {
      jax.tree_util.keystr(k): np.asarray(v)
      for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def _clip(grads, max_norm):
  norm = np.sqrt(sum(np.sum(g.astype(np.float64)**2) for g in grads.values()))
  if max_norm > 0 and norm >= max_norm:
    return {k: g * (max_norm / norm) for k, g in grads.items()}
  return grads


def _reference(kind, params, grads_list, lrs, wd, clip, b1=0.9, b2=0.999, mom=0.9, eps=1e-8):
  """Hand-written update: clip -> Adam / momentum -> + wd * p on kernels -> p -= lr * u."""
  p = {k: v.astype(np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v2 = {k: np.zeros_like(v) for k, v in p.items()}
  for t, (grads, lr) in enumerate(zip(grads_list, lrs), start=1):
    g = _clip({k: x.astype(np.float64) for k, x in grads.items()}, clip)
    for k in p:
      if kind == 'adam':
        m[k] = b1 * m[k] + (1 - b1) * g[k]
        v2[k] = b2 * v2[k] + (1 - b2) * g[k]**2
        u = (m[k] / (1 - b1**t)) / (np.sqrt(v2[k] / (1 - b2**t)) + eps)
      else:
        m[k] = g[k] + mom * m[k]
        u = m[k]
      if k.endswith("['kernel']"):
        u = u + wd * p[k]
      p[k] = p[k] - lr * u
  return p


@pytest.mark.parametrize('kind', ['adam', 'sgd'])
@pytest.mark.parametrize('grad_scale,clip', [(10.0, 1.0), (0.01, 1.0), (10.0, 0.0)])
def test_two_steps_match_numpy(kind, grad_scale, clip):
  # No warm-up, linear decay over 4 steps: lr 0.1 then 0.075.
  c = _config(optimizer=kind, warmup_steps=0, total_steps=4, weight_decay=0.3, grad_clip_norm=clip)
  tx = optim.make_optimizer(c, 4)
  params = jax.tree.map(jnp.asarray, _params())
  state = tx.init(params)
  grads_list = [_grads(grad_scale), jax.tree.map(lambda g: -0.5 * g, _grads(grad_scale))]
  step = jax.jit(tx.update)
  for grads in grads_list:
    updates, state = step(jax.tree.map(jnp.asarray, grads), state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
  expected = _reference(kind, _flat(_params()), [_flat(g) for g in grads_list], [0.1, 0.075],
                        wd=0.3, clip=clip)
  got = _flat(params)
  for k in expected:
    np.testing.assert_allclose(got[k], expected[k], rtol=2e-5, atol=1e-6, err_msg=k)


def test_weight_decay_only_on_kernels():
  c = _config(optimizer='sgd', warmup_steps=0, total_steps=10, weight_decay=0.5)
  tx = optim.make_optimizer(c, 10)
  params = jax.tree.map(jnp.asarray, _params())
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  for k, u in _flat(updates).items():
    if k.endswith("['kernel']"):
      np.testing.assert_allclose(u, -0.1 * 0.5 * _flat(_params())[k], rtol=1e-6)
    else:
      assert not np.any(u), k


def test_state_moments_mirror_params():
  params = jax.tree.map(jnp.asarray, _params())
  for kind in ('adam', 'sgd'):
    tx = optim.make_optimizer(_config(optimizer=kind, weight_decay=0.1), 1100)
    state = tx.init(params)
    moments = [
        s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, dict))
        if isinstance(s, dict)
    ]
    assert moments, kind
    for tree in moments:
      assert jax.tree.structure(tree) == jax.tree.structure(params)
      assert all(a.shape == b.shape for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(params)))


# validate().
def test_validate_accepts_good_config():
  optim.validate(_config())
  optim.validate(_config(total_steps=-1, num_epochs=7.0), num_train_examples=10**6)


@pytest.mark.parametrize('overrides,field', [
    (dict(optimizer='adamw'), 'optimizer'),
    (dict(lr_decay='step'), 'lr_decay'),
    (dict(loss='mse'), 'loss'),
    (dict(base_lr=0.0), 'base_lr'),
    (dict(end_lr=0.5), 'end_lr'),
    (dict(end_lr=-1.0), 'end_lr'),
    (dict(lr_decay='cosine', end_lr=1e-5), 'end_lr'),
    (dict(warmup_steps=-1), 'warmup_steps'),
    (dict(warmup_steps=20000, total_steps=10000), 'warmup_steps'),
    (dict(total_steps=-1, num_epochs=-1.0), 'total_steps'),
    (dict(total_steps=100, num_epochs=2.0), 'total_steps'),
    (dict(batch_size=0), 'batch_size'),
    (dict(accum_steps=3), 'accum_steps'),
    (dict(weight_decay=-0.1), 'weight_decay'),
    (dict(grad_clip_norm=-1.0), 'grad_clip_norm'),
    (dict(adam_b1=1.0), 'adam_b1'),
    (dict(adam_b2=-0.1), 'adam_b2'),
    (dict(momentum=1.5), 'momentum'),
    (dict(lr_grid=(0.01, -0.03)), 'lr_grid'),
    (dict(lr_grid=('0.01,x',)), 'lr_grid'),
])
def test_validate_rejects(overrides, field):
  with pytest.raises(ValueError) as e:
    optim.validate(_config(**overrides))
  msg = str(e.value)
  assert msg.startswith(field) or f' {field} ' in msg or f'{field}=' in msg, msg
  assert f'--config.{field}' in msg, msg
  assert '\n' not in msg


def test_a_run_without_a_length_names_both_values():
  with pytest.raises(
      ValueError, match=r'^total_steps 0 and num_epochs -1.0 give the run no '
      r'length \(each <= 0 is unset\): set --config.total_steps'):
    optim.validate(_config(total_steps=0, num_epochs=-1.0))


def test_validate_warmup_against_derived_steps():
  c = _config(total_steps=-1, num_epochs=1.0, warmup_steps=10_000, batch_size=512)
  optim.validate(c)  # The dataset size is not known yet: nothing to compare.
  with pytest.raises(ValueError, match='warmup_steps 10000 >= total_steps 98'):
    optim.validate(c, num_train_examples=50_000)
