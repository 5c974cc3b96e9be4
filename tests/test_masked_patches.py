"""Masked patch prediction (vit_jax/masked_patches.py, configs/masked_patches.py)."""
import gzip
import json
import logging
import os
import shutil
import subprocess
import sys
import types

import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import chrono as chrono_lib
from vit_jax import config_checks
from vit_jax import evaluate_cli
from vit_jax import flops
from vit_jax import masked_patches as mp
from vit_jax import models
from vit_jax import train
from vit_jax import step as step_lib
from vit_jax.configs import common
from vit_jax.configs import masked_patches as mp_configs
from tests import data_fixtures
from tests.conftest import ROOT

TINY = dict(patch_size=4, hidden_size=16, mlp_dim=32, num_heads=2, num_layers=1)


def _model(num_classes=10, **kw):
  return models.get_model('ViT-Ti_16', num_classes, **{**TINY, **kw})


def _cfg(**kw):
  c = mp.default_config()
  c.update(kw)
  return c


def _images(n=4, size=16, seed=0):
  """Images as the pipeline makes them: 8-bit values scaled to [-1, 1]; and the values."""
  v = np.random.default_rng(seed).integers(0, 256, (n, size, size, 3))
  return (v / 127.5 - 1).astype(np.float32), v


# ------------------------------------------------------------------ the model
def test_ordinary_parameter_tree_is_unchanged():
  for kw in ({}, {'representation_size': 16}, {'classifier': 'gap'}):
    model = _model(**kw)
    params = jax.eval_shape(lambda m=model: m.init(jax.random.PRNGKey(0), jnp.zeros(
        (1, 16, 16, 3)))['params'])
    top = set(params)
    assert not top & set(mp.PRETRAIN_ONLY)
    want = {'embedding', 'Transformer', 'head'} | ({'cls'} if 'classifier' not in kw else set())
    assert top == want | ({'pre_logits'} if 'representation_size' in kw else set())
  b16 = jax.eval_shape(lambda: models.get_model('ViT-B_16', 1000).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 224, 224, 3)))['params'])
  assert set(b16) == {'embedding', 'cls', 'Transformer', 'head'}


@pytest.mark.parametrize('target,outputs', [('mean_color', 512), ('downsized', 16 * 512),
                                            ('pixels', 48)])
def test_pretraining_tree_and_shapes(target, outputs):
  cfg = _cfg(target=target)
  model = _model(0)
  params = jax.eval_shape(lambda: mp.init_params(model, jax.random.PRNGKey(0), 16, cfg))
  assert set(params) == {'embedding', 'cls', 'Transformer', 'mask_embedding', 'masked_patch_head'}
  assert params['mask_embedding'].shape == (1, 1, 16)
  assert params['masked_patch_head']['kernel'].shape == (16, outputs)
  images = jax.ShapeDtypeStruct((4, 16, 16, 3), jnp.float32)
  corrupt = jax.eval_shape(lambda: mp.draw_corruption(jax.random.PRNGKey(1), 4, 16, cfg))
  assert corrupt[0].shape == corrupt[1].shape == (4, 16)
  out = jax.eval_shape(lambda p, x, c: mp.apply(model, p, x, c, cfg, train=False), params, images,
                       corrupt)
  assert out.shape == (4, 16, outputs)
  t = jax.eval_shape(lambda x: mp.targets(x, 4, cfg), images)
  assert t.shape == {'mean_color': (4, 16), 'downsized': (4, 16, 16), 'pixels': (4, 16, 48)}[target]
  assert mp.without_pretraining_params(params).keys() == {'embedding', 'cls', 'Transformer'}


def test_corruption_replaces_embeddings_before_position_embeddings():
  """A patch replaced by [mask] or by another patch no longer matters; a kept one does."""
  model, cfg = _model(0), _cfg()
  params = jax.jit(lambda r: mp.init_params(model, r, 16, cfg))(jax.random.PRNGKey(0))
  params['masked_patch_head']['kernel'] = jax.random.normal(jax.random.PRNGKey(2), (16, 512))
  images, _ = _images(1)
  kind = np.zeros((1, 16), np.int32)
  source = (np.arange(16)[None] + 1) % 16
  kind[0, 3], kind[0, 7], kind[0, 9] = mp.MASK, mp.RANDOM, mp.SAME  # 7 takes patch 8
  apply = jax.jit(lambda x, k: mp.apply(model, params, x, (k, source), cfg, train=False))
  run = lambda x, k=kind: np.asarray(apply(x, k))
  base = run(images)

  def changed(patch):
    x = images.copy()
    r, c = divmod(patch, 4)
    x[0, 4 * r:4 * r + 4, 4 * c:4 * c + 4] *= -1
    return run(x)

  np.testing.assert_array_equal(changed(3), base)  # masked: its pixels are gone
  np.testing.assert_array_equal(changed(7), base)  # replaced by patch 8
  assert not np.allclose(changed(8), base)  # patch 8 is seen twice
  assert not np.allclose(changed(9), base)  # corrupted but kept as is
  # The [mask] embedding goes in before the position embeddings: two masked patches
  # at different positions get different representations.
  kind2 = np.zeros((1, 16), np.int32)
  kind2[0, [0, 15]] = mp.MASK
  out = run(images, kind2)
  assert not np.allclose(out[0, 0], out[0, 15])


# ------------------------------------------------------------------ corruption
def test_masking_statistics_50_80_10_10():
  cfg = _cfg()
  n, num = 2048, 196
  kind, source = jax.jit(lambda r: mp.draw_corruption(r, n, num, cfg))(jax.random.PRNGKey(0))
  kind, source = np.asarray(kind), np.asarray(source)
  per_image = (kind != mp.KEEP).sum(1)
  assert (per_image == 98).all()  # exactly 50% of every image
  corrupted = kind[kind != mp.KEEP]
  frac = {k: np.mean(corrupted == k) for k in (mp.MASK, mp.RANDOM, mp.SAME)}
  # 200,704 draws: the standard error of 10% is 0.07% (of 80%: 0.09%).
  assert abs(frac[mp.MASK] - 0.8) < 0.005
  assert abs(frac[mp.RANDOM] - 0.1) < 0.005
  assert abs(frac[mp.SAME] - 0.1) < 0.005
  # Which patches are picked is uniform over positions, and independent of the kind.
  assert np.abs((kind != mp.KEEP).mean(0) - 0.5).max() < 0.05
  # A random patch is another one, uniform over the other positions.
  assert (source != np.arange(num)[None]).all()
  offsets = ((source - np.arange(num)[None]) % num).ravel()
  counts = np.bincount(offsets, minlength=num)
  assert counts[0] == 0 and counts[1:].min() > 0.8 * counts[1:].mean()
  # Other rates: a fixed count per image, round half up.
  k, _ = mp.draw_corruption(jax.random.PRNGKey(1), 8, 49, _cfg(corrupt_rate=0.15))
  assert mp.num_corrupted(49, 0.15) == 7
  assert ((np.asarray(k) != mp.KEEP).sum(1) == 7).all()


def test_corruption_is_a_function_of_seed_and_step_and_not_of_devices():
  cfg = _cfg()
  rng = jax.random.fold_in(jax.random.PRNGKey(0), 7)
  draw = jax.jit(lambda r: mp.corruption_for_step(r, 64, 49, cfg))
  one = draw(rng)
  np.testing.assert_array_equal(one[0], draw(rng)[0])
  other = draw(jax.random.fold_in(jax.random.PRNGKey(0), 8))
  assert (np.asarray(one[0]) != np.asarray(other[0])).any()
  assert jax.device_count() == 8
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  eight = jax.jit(lambda r: mp.corruption_for_step(r, 64, 49, cfg),
                  out_shardings=(sharded, sharded))(rng)
  assert len(eight[0].sharding.device_set) == 8
  np.testing.assert_array_equal(np.asarray(eight[0]), np.asarray(one[0]))
  np.testing.assert_array_equal(np.asarray(eight[1]), np.asarray(one[1]))


# -------------------------------------------------------------------- targets
def _reference(v, p, target, bits=3, d=4):
  """Loops over patches in float64 from the 8-bit values."""
  n, s = v.shape[:2]
  g = s // p
  out = []
  code = lambda c: int(((c[0] * 2**bits) + c[1]) * 2**bits + c[2])
  for i in range(n):
    row = []
    for r in range(g):
      for c in range(g):
        patch = v[i, r * p:(r + 1) * p, c * p:(c + 1) * p].astype(np.float64)
        if target == 'mean_color':
          row.append(code(np.floor(patch.mean((0, 1)) * 2**bits / 256)))
        elif target == 'downsized':
          b = p // d
          row.append([
              code(
                  np.floor(patch[y * b:(y + 1) * b, x * b:(x + 1) * b].mean(
                      (0, 1)) * 2**bits / 256)) for y in range(d) for x in range(d)
          ])
        else:
          row.append((patch / 127.5 - 1).ravel())
    out.append(row)
  return np.array(out)


@pytest.mark.parametrize('target,p', [('mean_color', 4), ('mean_color', 8), ('downsized', 8),
                                      ('pixels', 4)])
def test_targets_against_numpy(target, p):
  images, v = _images(3, 16, seed=p)
  got = np.asarray(mp.targets(jnp.asarray(images), p, _cfg(target=target)))
  want = _reference(v, p, target)
  if target == 'pixels':
    np.testing.assert_allclose(got, want, atol=1e-6)
  else:
    np.testing.assert_array_equal(got, want)
  if target == 'mean_color':  # and the classes are r * 64 + g * 8 + b
    assert mp.quantize(jnp.array([[1.0, -1.0, 128 / 127.5 - 1]]), 3)[0] == 7 * 64 + 0 * 8 + 4


def test_gray_extreme_and_edge_colours():
  x = jnp.stack([jnp.full((4, 4, 3), -1.0), jnp.full((4, 4, 3), 1.0)])
  np.testing.assert_array_equal(mp.targets(x, 4, _cfg())[:, 0], [0, 511])
  # Means exactly on a bin edge (8-bit 32k) go up, as in exact arithmetic, for every
  # patch size up to 32 (means are multiples of 1/1024 of an 8-bit step).
  k = np.arange(1, 8)
  for p in (4, 16, 32):
    v = np.full((7, p, p, 3), 1.0) * (32 * k)[:, None, None, None]
    v[:, 0, 0] -= 1
    v[:, 0, 1] += 1  # the same mean, not all values equal
    below = v.copy()
    below[:, 0, 1] -= 1  # a mean 1/p^2 of a step below the edge
    both = jnp.asarray(np.concatenate([v, below]) / 127.5 - 1, jnp.float32)
    got = np.asarray(mp.targets(both, p, _cfg()))[:, 0]
    np.testing.assert_array_equal(got, np.concatenate([k, k - 1]) * 73, err_msg=str(p))


# ----------------------------------------------------------------------- loss
def test_loss_counts_only_corrupted_patches():
  rng = np.random.default_rng(0)
  out = rng.normal(size=(2, 5, 512)).astype(np.float32)
  target = rng.integers(0, 512, (2, 5))
  kind = np.array([[0, 1, 2, 3, 0], [1, 0, 0, 0, 0]])
  loss, metrics = mp.prediction_loss(out, target, kind, 'mean_color')
  logp = out - np.log(np.exp(out).sum(-1, keepdims=True))
  picked = [(0, 1), (0, 2), (0, 3), (1, 0)]
  want = -np.mean([logp[i, j, target[i, j]] for i, j in picked])
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  right = np.mean([out[i, j].argmax() == target[i, j] for i, j in picked])
  np.testing.assert_allclose(metrics['masked_patch_accuracy'], right)
  # downsized: the mean over the 16 cells; pixels: the mean squared error.
  out16 = rng.normal(size=(2, 5, 16 * 512)).astype(np.float32)
  t16 = rng.integers(0, 512, (2, 5, 16))
  loss16, _ = mp.prediction_loss(out16, t16, kind, 'downsized')
  lp = jax.nn.log_softmax(out16.reshape(2, 5, 16, 512))
  want16 = -np.mean(
      [np.mean(np.take_along_axis(lp[i, j], t16[i, j][:, None], -1)) for i, j in picked])
  np.testing.assert_allclose(loss16, want16, rtol=1e-5)
  y = rng.normal(size=(2, 5, 48)).astype(np.float32)
  t = rng.normal(size=(2, 5, 48)).astype(np.float32)
  l2, _ = mp.prediction_loss(y, t, kind, 'pixels')
  np.testing.assert_allclose(l2, np.mean([np.mean((y[i, j] - t[i, j])**2) for i, j in picked]),
                             rtol=1e-5)


# ---------------------------------------------------------------------- configs
def test_named_configs_follow_the_paper():
  jft = mp_configs.get_config('ViT-B_16,jft300m')
  assert (jft.objective, jft.model_name, jft.batch_size,
          jft.total_steps) == ('masked_patches', 'ViT-B_16', 4096, 1_000_000)
  assert (jft.optimizer, jft.base_lr, jft.warmup_steps, jft.lr_decay) == ('adam', 2e-4, 10_000,
                                                                          'cosine')
  # "1M steps (ca. 14 epochs)" of JFT-300M at batch 4096.
  assert round(jft.total_steps * jft.batch_size / jft.num_train_examples) == 14
  m = jft.masked_patches
  assert (m.target, m.corrupt_rate, m.mask_prob, m.random_prob, m.bits) == ('mean_color', 0.5, 0.8,
                                                                            0.1, 3)
  assert 'representation_size' not in jft.model
  i21k = mp_configs.get_config('ViT-B_16,imagenet21k')
  assert (i21k.dataset, i21k.total_steps, i21k.base_lr) == ('imagenet21k', 100_000, 2e-4)
  assert mp_configs.get_config('ViT-B_16,imagenet2012').dataset == 'imagenet2012'
  q = mp_configs.get_config('quickstart')
  assert q.objective == 'masked_patches' and q.dataset == 'fashion_mnist_local'
  for c in (jft, i21k, q):
    mp.validate(c)
    config_checks.validate_config(c, 60_000)
  # common.py holds the same fields and defaults as masked_patches.default_config().
  base = common.get_config()
  assert base.objective == 'classification'
  assert base.masked_patches.to_dict() == mp.default_config().to_dict()


@pytest.mark.parametrize('arg,words', [
    ('ViT-B_16', 'Bad masked_patches argument'),
    ('ViT-B_16,cifar10', "dataset 'cifar10'"),
    ('R50+ViT-B_16,jft300m', 'not a plain ViT'),
])
def test_bad_config_arguments(arg, words):
  with pytest.raises(ValueError, match=words):
    mp_configs.get_config(arg)


@pytest.mark.parametrize('field,value,words', [
    ('objective', 'mae', "objective 'mae' is unknown"),
    ('masked_patches.target', 'colour', 'masked_patches.target'),
    ('masked_patches.corrupt_rate', 0.0, 'masked_patches.corrupt_rate'),
    ('masked_patches.mask_prob', 0.95, 'exceed 1'),
    ('masked_patches.bits', 9, 'masked_patches.bits'),
    ('masked_patches.downsize', 3, 'does not divide the patch size 4'),
    ('model_name', 'R50+ViT-B_16', 'needs a plain ViT'),
    ('pretrained_path', '/x.npz', 'pretrained_path'),
])
def test_bad_values_are_one_line_errors(field, value, words):
  c = mp_configs.get_config('quickstart')
  if field == 'masked_patches.downsize':
    c.masked_patches.target = 'downsized'
  if field == 'model_name':
    c.model = ml_collections.ConfigDict()
  node, name = (c.masked_patches, field.split('.')[1]) if '.' in field else (c, field)
  node[name] = value
  with pytest.raises(ValueError, match=words) as e:
    mp.validate(c)
  assert '\n' not in str(e.value)


# -------------------------------------------------------------------- the loop
def _tiny_run_config(**kw):
  c = mp_configs.get_config('quickstart')
  c.model.update(TINY)
  c.image_size = 16
  c.total_steps, c.warmup_steps, c.batch_size = 4, 1, 16
  c.eval_batch_size, c.eval_split = 64, 'test[:64]'
  c.log_every_steps, c.eval_every_steps, c.checkpoint_every_steps = 2, 0, 0
  c.update(kw)
  return c


@pytest.fixture
def compilation_cache(tmp_path):
  """JAX's persistent compilation cache in tmp_path, for this test only: a second run of
  the same config then compiles nothing (the test's cost is the first run's compiles)."""
  from jax._src import compilation_cache as cache  # pylint: disable=g-import-not-at-top
  names = ('jax_compilation_cache_dir', 'jax_persistent_cache_min_compile_time_secs')
  before = {n: getattr(jax.config, n) for n in names}
  jax.config.update(names[0], str(tmp_path / 'jax_cache'))
  jax.config.update(names[1], 0.0)
  cache.reset_cache()
  yield
  for n, v in before.items():
    jax.config.update(n, v)
  cache.reset_cache()


def test_train_resume_and_load_pretrained(tmp_path, compilation_cache, caplog):  # pylint: disable=redefined-outer-name,unused-argument
  """A short run through train_and_evaluate, which reports its MFU; stopped and resumed it
  gives the same bits; its final.npz fine-tunes through load_pretrained (head and mask
  embedding dropped)."""
  c = _tiny_run_config(checkpoint_every_steps=2, keep_checkpoints=-1)
  with caplog.at_level(logging.INFO):
    straight = train.train_and_evaluate(c, str(tmp_path / 'a'))
  flops_text = chrono_lib.setup_text(1, flops.step_flops(c, 10), 1, '').split('; ')[1]
  assert f' parameters; {flops_text};' in caplog.text and ' MFU ' in caplog.text
  # vit-evaluate on the run: few-shot by default, as its head predicts pixels, not classes.
  args = dict(workdir=str(tmp_path / 'a'), checkpoint=None, mode=None, train_split='train[:64]',
              eval_split='test[:64]', shots=['1'], seeds=['0'], l2_reg=1024.0, batch_size=64)
  table = evaluate_cli.run(types.SimpleNamespace(**args)).splitlines()
  assert [row.split()[:3] for row in table[1:]] == [['fewshot', 'fashion_mnist_local', '1-shot']]
  with pytest.raises(ValueError, match=r'is a masked_patches run: .* use --mode fewshot'):
    evaluate_cli.run(types.SimpleNamespace(**{**args, 'mode': 'top1'}))
  # The run as if it had stopped after step 2: its files then, without what came after.
  shutil.copytree(tmp_path / 'a', tmp_path / 'b', ignore=shutil.ignore_patterns('final.npz'))
  shutil.rmtree(tmp_path / 'b' / 'checkpoints' / '4')
  resumed = train.train_and_evaluate(c, str(tmp_path / 'b'))
  assert straight['step'] == resumed['step'] == 4
  assert 0 <= straight['accuracy'] <= 1
  flat = lambda p: flax.traverse_util.flatten_dict(jax.device_get(p), sep='/')
  a, b = flat(straight['params']), flat(resumed['params'])
  assert a.keys() == b.keys() and 'mask_embedding' in a
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  # Another target's head cannot resume: the fix named is one that is not refused (masked
  # pre-training takes no pretrained_path; it had been suggested as it was).
  other = _tiny_run_config(checkpoint_every_steps=2, keep_checkpoints=-1, total_steps=6,
                           resume_changes='masked_patches.target,total_steps')
  other.masked_patches.target = 'pixels'
  with pytest.raises(
      train.ConfigError, match=r'holds checkpoints of another model \(.*\): use '
      r'another --workdir, or fine-tune a classification config from that run '
      r'with --config.pretrained_path=\S+/b/final.npz$'):
    train.train_and_evaluate(other, str(tmp_path / 'b'))

  model = _model(10)
  params = checkpoint.load_pretrained(str(tmp_path / 'a' / 'final.npz'), model, 10, 16)
  assert set(params) == {'embedding', 'cls', 'Transformer', 'head'}
  np.testing.assert_array_equal(params['embedding']['kernel'], a['embedding/kernel'])
  assert not np.any(params['head']['kernel'])
  logits = model.apply({'params': params}, jnp.zeros((2, 16, 16, 3)))
  assert logits.shape == (2, 10)


def test_train_step_same_on_one_and_eight_devices_and_with_accumulation():
  c = _tiny_run_config()
  model = train.build_model(c, 0)
  from vit_jax import optim, sharding  # pylint: disable=g-import-not-at-top
  tx = optim.make_optimizer(c, 4)
  params = jax.jit(lambda r: mp.init_params(model, r, 16, c.masked_patches))(jax.random.PRNGKey(0))
  images, _ = _images(16, 16)
  batch = {'image': images, 'label': np.zeros(16, np.int32)}
  out = {}
  for devices, accum in ((1, 1), (8, 2)):
    cc = ml_collections.ConfigDict(c.to_dict())
    cc.mesh_data, cc.accum_steps = devices, accum
    mesh = sharding.make_mesh(cc)
    step = jax.jit(step_lib.make_train_step(model, tx, lambda s: 0.0, cc, mesh))
    state = {'step': jnp.int32(3), 'params': params, 'opt_state': tx.init(params)}
    data = jax.device_put(batch, sharding.data_sharding(mesh))
    new, metrics = step(state, data, jax.random.PRNGKey(0))
    out[devices, accum] = (float(metrics['loss']), jax.device_get(new['params']))
  for key in ((8, 2),):
    np.testing.assert_allclose(out[key][0], out[1, 1][0], rtol=1e-5)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), out[key][1],
                 out[1, 1][1])


def test_the_experiment_refuses_results_made_with_other_flags(tmp_path):
  """A second start with another --pretrain_steps had printed the first start's table as
  its own, exit 0."""
  recorded = dict(pretrain_steps=20, finetune_steps=10, finetune_batch=64, finetune_lr=1e-3,
                  fewshot_pool=2000, fewshot_draws=5, data_dir='')
  (tmp_path / 'results.json').write_text(json.dumps({'finetune': {}, 'flags': recorded}))
  out = subprocess.run([
      sys.executable,
      os.path.join(ROOT, 'experiments', 'masked_patches_fashion.py'), '--workdir=.',
      '--pretrain_steps=30', '--finetune_steps=10'
  ], cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert (out.returncode, out.stderr.strip().splitlines()[-1:]) == (1, [
      'masked_patches_fashion: ./results.json holds results made with other flags '
      '(--pretrain_steps=20 -> 30): pass the same flags to reuse them, or another --workdir'
  ]), out.stderr[-3000:]
  assert json.loads((tmp_path / 'results.json').read_text())['flags'] == recorded


@pytest.mark.parametrize('flag,line', [
    ('--labels=600,abc', "masked_patches_fashion.py: flag --labels=['600', 'abc']: give whole "
     'numbers from 1 to 60,000, comma-separated (see --help)'),
    ('--seeds=x', "masked_patches_fashion.py: flag --seeds=['x']: give whole numbers 0 or more, "
     'comma-separated (see --help)'),
    ('--pretrain_steps=0', 'masked_patches_fashion.py: flag --pretrain_steps=0: 0 is not a '
     'positive integer (see --help)'),
    ('--fewshot_pool=20', 'masked_patches_fashion.py: flag --fewshot_pool=20: 20 is not integer '
     '>= 50 (see --help)'),
    ('--finetune_lr=0', 'masked_patches_fashion: the fine-tuning on 600 labels is refused: '
     'base_lr 0.0 must be > 0: set --config.base_lr (its config is made from this script\'s '
     'flags: see --help)'),
])
def test_the_experiment_refuses_a_bad_flag_before_it_trains(tmp_path, flag, line):
  """--labels=600,abc had pre-trained and fine-tuned for minutes, then ended in int()'s
  traceback; --pretrain_steps=0 in a ConfigError's."""
  out = subprocess.run([
      sys.executable,
      os.path.join(ROOT, 'experiments', 'masked_patches_fashion.py'), '--workdir=mp', flag
  ], cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert (out.returncode, out.stderr.strip().splitlines()[-1]) == (1, line), out.stderr[-3000:]
  assert os.listdir(tmp_path) == []


def test_the_experiment_checks_its_few_shot_pool_before_it_trains(tmp_path):
  """A class with fewer than 5 images in the pool had ended the run in a traceback after all
  of its training; the random init's few-shot accuracy, which needs none, now comes first."""
  data = data_fixtures.write_idx(str(tmp_path / 'fashion'), num_train=60)
  labels = np.arange(60) % 9  # class 9 only twice, at the end
  labels[-2:] = 9
  with gzip.open(os.path.join(data, 'train-labels-idx1-ubyte.gz'), 'wb') as f:
    f.write(np.array([2049, 60], '>i4').tobytes() + labels.astype(np.uint8).tobytes())
  out = subprocess.run([
      sys.executable,
      os.path.join(ROOT, 'experiments', 'masked_patches_fashion.py'), '--workdir=mp',
      '--data_dir=fashion', '--fewshot_pool=60', '--labels=20', '--pretrain_steps=1'
  ], cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert (out.returncode, out.stderr.strip().splitlines()[-1]) == (
      1, 'masked_patches_fashion: the 5-shot draws from the first 60 training images '
      '(--fewshot_pool): Class 9 has 2 examples, fewer than 5 shots: use a larger few-shot train '
      'split or fewer shots'), out.stderr[-3000:]
  assert os.listdir(tmp_path / 'mp') == []  # no pre-training started, no results written
