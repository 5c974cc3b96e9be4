"""Tests for vit_jax.evaluate (the closed-form few-shot regression, k-shot draws, feature
extraction, the evaluator) and its CLI, vit_jax.evaluate_cli, on a tiny ViT and IDX files
made here."""
import logging
import math
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import data_fixtures
from tests.conftest import CTRL_C_AS_IN_A_TERMINAL
from vit_jax import checkpoint
from vit_jax import config_checks
from vit_jax import evaluate
from vit_jax import evaluate_cli
from vit_jax import models
from vit_jax.configs import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(num_layers=2, hidden_size=32, mlp_dim=64, num_heads=2, patch_size=7)


def _lstsq_reference(x, labels, num_classes, l2_reg):
  """min ||Xw + b - Y||^2 + l2 ||w||^2 as one least-squares system (bias free)."""
  n, d = x.shape
  y = 2.0 * np.eye(num_classes)[labels] - 1.0
  a = np.block([[x, np.ones((n, 1))], [np.sqrt(l2_reg) * np.eye(d), np.zeros((d, 1))]])
  rhs = np.concatenate([y, np.zeros((d, num_classes))])
  sol = np.linalg.lstsq(a, rhs, rcond=None)[0]
  return sol[:d], sol[d]


@pytest.mark.parametrize('n,d', [(50, 8), (6, 20)])  # primal and dual branches
@pytest.mark.parametrize('l2_reg', [0.5, 1024.0])
def test_fit_linear_matches_lstsq(n, d, l2_reg):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, d)) * 3 + 1
  labels = rng.integers(0, 3, n)
  w, b = evaluate.fit_linear(x.astype(np.float32), labels, 3, l2_reg)
  w_ref, b_ref = _lstsq_reference(x.astype(np.float32).astype(np.float64), labels, 3, l2_reg)
  np.testing.assert_allclose(w, w_ref, atol=1e-5)
  np.testing.assert_allclose(b, b_ref, atol=1e-5)
  test = rng.normal(size=(7, d))
  np.testing.assert_allclose(evaluate.predict(w, b, test), test @ w_ref + b_ref, atol=1e-5)


def test_fit_linear_rejects_zero_regulariser():
  with pytest.raises(ValueError, match='l2_reg'):
    evaluate.fit_linear(np.zeros((3, 2)), np.array([0, 1, 0]), 2, 0.0)


def test_sample_k_shot_exact_and_deterministic():
  labels = np.repeat(np.arange(4), [5, 7, 30, 6])
  for k in (1, 5):
    idx = evaluate.sample_k_shot(labels, k, seed=3)
    np.testing.assert_array_equal(np.bincount(labels[idx], minlength=4), [k] * 4)
    assert len(set(idx.tolist())) == len(idx)
    np.testing.assert_array_equal(idx, evaluate.sample_k_shot(labels, k, seed=3))
  assert not np.array_equal(evaluate.sample_k_shot(labels, 5, 0),
                            evaluate.sample_k_shot(labels, 5, 1))
  # Nested: the 1-shot draw of a seed is inside its 5-shot draw.
  assert set(evaluate.sample_k_shot(labels, 1, 2)) <= set(evaluate.sample_k_shot(labels, 5, 2))
  with pytest.raises(ValueError, match='^Class 0 has 5 examples, fewer than 6 shots'):
    evaluate.sample_k_shot(labels, 6, 0)
  with pytest.raises(ValueError, match=r'^Class 0 \(bird\) has 5 examples, fewer than 6 shots'):
    evaluate.sample_k_shot(labels, 6, 0, class_names=('bird', 'cat', 'dog', 'eel'))


@pytest.mark.parametrize(
    'call,message',
    [
        # A label past num_classes had been scored as a class the fit cannot predict.
        (lambda x, y: evaluate.fit_linear(x, y, 3),
         r'^labels run from 0 to 4, outside the 3 classes '
         r'0\.\.2: pass the number of classes$'),
        (lambda x, y: evaluate.fewshot_accuracy(x, y, x, y, 3, shots=(2,), seeds=(0,)),
         r'^train_y run from 0 to 4, outside the 3 classes'),
        # numpy's own words had been "matmul: Input operand 1 has a mismatch ..." and "not enough
        # values to unpack".
        (lambda x, y: evaluate.fit_linear(x, y[:50], 5),
         r'^features \(100, 8\) and labels \(50,\): '
         r'expected \[N, D\] features and N integer labels$'),
        (lambda x, y: evaluate.fit_linear(x[:, 0], y, 5), r'^features \(100,\) and labels'),
        (lambda x, y: evaluate.fewshot_accuracy(x, y, x[:, :4], y, 5, shots=(2,), seeds=(0,)),
         r'^train_x has 8 features per example, test_x 4: extract both with the same model$'),
    ])
def test_bad_features_or_labels_are_named(call, message):
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(100, 8)), np.arange(100) % 5
  with pytest.raises(ValueError, match=message):
    call(x, y)


def test_fewshot_accuracy_defaults_to_what_vit_evaluate_computes():
  """The function's standardise had been off, the configs' and vit-evaluate's on: a call
  with the defaults gave other figures than the command."""
  rng = np.random.default_rng(2)
  y = np.arange(60) % 3
  x = (rng.normal(size=(60, 6)) + 2 * np.eye(3, 6)[y]) * np.array([1e-3, 1e-3, 1e2, 1, 1, 1])
  default = evaluate.fewshot_accuracy(x, y, x, y, 3, shots=(5,), seeds=(0, 1))
  assert default == evaluate.fewshot_accuracy(x, y, x, y, 3, shots=(5,), seeds=(0, 1),
                                              standardise=common.get_config().fewshot_standardise)
  assert default != evaluate.fewshot_accuracy(x, y, x, y, 3, shots=(5,), seeds=(0, 1),
                                              standardise=not evaluate.DEFAULT_STANDARDISE)


def test_separable_features_give_accuracy_one():
  rng = np.random.default_rng(1)
  centres = 10.0 * np.eye(5, 16)
  train_y, test_y = np.repeat(np.arange(5), 10), np.repeat(np.arange(5), 20)
  train_x = centres[train_y] + 0.1 * rng.normal(size=(50, 16))
  test_x = centres[test_y] + 0.1 * rng.normal(size=(100, 16))
  out = evaluate.fewshot_accuracy(train_x, train_y, test_x, test_y, 5, shots=(1, 5), seeds=(0, 1),
                                  standardise=False)
  assert set(out) == {1, 5}
  for r in out.values():
    assert r['mean'] == 1.0 and r['per_seed'] == [1.0, 1.0] and r['std'] == 0.0


def test_standardised_fit_matches_numpy_and_ignores_feature_scales():
  rng = np.random.default_rng(4)
  train_y, test_y = np.repeat(np.arange(3), 8), np.repeat(np.arange(3), 10)
  centres = np.pad(3 * rng.normal(size=(3, 2)), ((0, 0), (0, 4)))  # classes differ in dims 0-1
  scales = np.array([1e-3, 1e-3, 1e2, 1e2, 1e2, 1e2])  # ... which are the tiny ones
  train_x = (centres[train_y] + 0.8 * rng.normal(size=(24, 6))) * scales
  test_x = (centres[test_y] + 0.8 * rng.normal(size=(30, 6))) * scales
  draw = lambda k, seed: evaluate.sample_k_shot(train_y, k, seed)
  got = evaluate.fewshot_accuracy(train_x, train_y, test_x, test_y, 3, shots=(2, 8), seeds=(0, 1),
                                  l2_reg=4.0, standardise=True)
  for k in (2, 8):
    for seed, acc in zip((0, 1), got[k]['per_seed']):
      idx = draw(k, seed)
      mean, std = train_x[idx].mean(0), train_x[idx].std(0)
      w, b = _lstsq_reference((train_x[idx] - mean) / std, train_y[idx], 3, 4.0)
      pred = np.argmax(((test_x - mean) / std) @ w + b, -1)
      assert acc == pytest.approx(np.mean(pred == test_y), abs=1e-12)
  # Standardised: the same for any per-feature scaling; plain ridge is not.
  rescale = rng.uniform(0.01, 100.0, 6)
  again = evaluate.fewshot_accuracy(train_x * rescale, train_y, test_x * rescale, test_y, 3,
                                    shots=(2, 8), seeds=(0, 1), l2_reg=4.0, standardise=True)
  assert again == got
  plain, unit = [
      evaluate.fewshot_accuracy(train_x * r, train_y, test_x * r, test_y, 3, shots=(8,), seeds=(0,),
                                l2_reg=4.0, standardise=False)[8]['mean']
      for r in (1.0, 1.0 / scales)
  ]
  assert plain < unit - 0.2 and got[8]['mean'] > plain + 0.2, (plain, unit, got[8]['mean'])
  # A feature constant over the k-shot set is only centred (no division by zero).
  x = np.concatenate([train_x, np.ones((24, 1))], 1)
  fit, held = evaluate.standardised(x, np.concatenate([test_x, 2 * np.ones((30, 1))], 1))
  assert np.all(fit[:, -1] == 0) and np.all(held[:, -1] == 1)


def test_dataset_labels_tell_folders_of_one_name_apart():
  """vit-evaluate had kept one row of two folders named data, and left one out of the mean."""
  datasets = ['folder:/x/c1/data', 'folder:/y/c2/data/', 'folder:ds1', 'cifar100', 'folder:/z/d']
  assert config_checks.dataset_labels(datasets) == ['c1/data', 'c2/data', 'ds1', 'cifar100', 'd']
  assert config_checks.dataset_labels(['folder:/r/a/x', 'folder:/s/a/x']) == ['r/a/x', 's/a/x']
  assert config_checks.dataset_labels(['folder:/a/x', 'folder:/a/x']) == ['x', 'x']  # one, twice


def test_fewshot_config_errors_name_the_fix():
  from vit_jax.configs import common  # pylint: disable=g-import-not-at-top
  c = common.get_config()
  c.fewshot_every_steps = 10
  config_checks.validate_fewshot(c)
  c.fewshot_dataset = 'cifar100'  # the field before fewshot_datasets
  with pytest.raises(ValueError, match=r'^fewshot_dataset: replaced by fewshot_datasets'):
    config_checks.validate_fewshot(c)
  del c.fewshot_dataset
  c.fewshot_datasets = ('cifar100',)
  with pytest.raises(ValueError, match="entry 'cifar100' is not \\(dataset, k-shot pool split"):
    config_checks.validate_fewshot(c)
  # Two folders of one name are told apart (they had been refused as one named twice); one
  # folder listed twice is refused.
  c.fewshot_datasets = (('folder:/a/pets', 'train', 'test'), ('folder:/b/pets/', 'train', 'test'))
  assert [t[0] for t in config_checks.fewshot_tasks(c)] == ['a/pets', 'b/pets']
  c.fewshot_datasets = (('folder:/a/pets', 'train', 'test'), ('folder:/a/pets/', 'train', 'test'))
  with pytest.raises(ValueError, match="names 'folder:/a/pets/' twice: list each dataset once"):
    config_checks.validate_fewshot(c)
  c.fewshot_datasets = (('folder:/a/pets', 'train', 'test'),)
  for field, value in (('fewshot_shots', ('a', 'b')), ('fewshot_shots', (0, 5)),
                       ('fewshot_shots', ()), ('fewshot_seeds', (0.5,))):
    bad = c.copy_and_resolve_references()
    bad[field] = value
    with pytest.raises(
        ValueError, match=f'^{field} .* is not a tuple of whole numbers.*: set e.g. '
        f'--config.{field}=1,5$'):
      config_checks.validate_fewshot(bad)
  c.fewshot_seeds = (0, 1, 0)
  with pytest.raises(
      ValueError, match=r'^fewshot_seeds \(0, 1, 0\) gives a value twice: set '
      '--config.fewshot_seeds with each once$'):
    config_checks.validate_fewshot(c)
  c.fewshot_seeds = (0, 1)
  c.fewshot_l2_reg = 0.0
  with pytest.raises(ValueError, match='^fewshot_l2_reg 0.0 is not positive'):
    config_checks.validate_fewshot(c)


def test_other_datasets_are_read_with_their_own_label_feature():
  """A multi-label run (label_key 'labels') evaluated few-shot on a single-label dataset."""
  run = evaluate_cli.cli_config(dataset='imagenet21k', label_key='labels')
  assert evaluate.data_config(run, dataset='cifar100', split='test').label_key == 'label'
  assert evaluate.data_config(run, split='test').label_key == 'labels'
  assert evaluate.data_config(run, dataset='imagenet21k', split='test').label_key == 'labels'


# ------------------------------------------------------------- end to end
@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
  tmp = tmp_path_factory.mktemp('fewshot')
  idx_dir = data_fixtures.write_idx(str(tmp / 'idx'), num_train=60, num_test=20)
  model = models.get_model('ViT-Ti_16', num_classes=10, **TINY)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 3)))['params']
  path = str(tmp / 'tiny.npz')
  checkpoint.save_npz(path, params)
  config = evaluate_cli.cli_config(dataset='fashion_mnist_local', data_dir=idx_dir, image_size=28,
                                   eval_batch_size=16, fewshot_shots=(1, 5), fewshot_seeds=(0, 1))
  return dict(idx_dir=idx_dir, model=model, params=params, path=path, config=config)


def test_extract_features_matches_direct_apply(tiny):
  feats, labels = evaluate.extract_features(tiny['model'], tiny['params'], tiny['config'], 'test',
                                            batch_size=16)
  assert feats.shape == (20, 32) and labels.shape == (20,)
  np.testing.assert_array_equal(labels, np.arange(60, 80) % 10)
  images = np.stack([data_fixtures.id_image(i) for i in range(60, 80)])
  images = np.repeat(images[..., None], 3, -1).astype(np.float32) / 127.5 - 1
  model0 = tiny['model'].clone(num_classes=0)
  direct = model0.apply({'params': tiny['params']}, images)
  np.testing.assert_allclose(feats, direct, atol=1e-5)


def test_a_model_with_a_pre_logits_layer_gives_its_representation(tiny, tmp_path):
  """The paper's pre-training models (and the published ImageNet-21k files) have one: its
  Dense layer and the sown features had shared the scope name 'pre_logits', so few-shot
  evaluation, vit-inspect and few-shot during training all failed ("Duplicate use of scope
  name")."""
  model = models.get_model('ViT-Ti_16', num_classes=10, representation_size=8, **TINY)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 3)))['params']
  feats, _ = evaluate.extract_features(model, params, tiny['config'], 'test', batch_size=16)
  images = np.stack([data_fixtures.id_image(i) for i in range(60, 80)])
  images = np.repeat(images[..., None], 3, -1).astype(np.float32) / 127.5 - 1
  direct = model.clone(num_classes=0).apply({'params': params}, images)  # tanh(pre_logits)
  assert feats.shape == (20, 8)
  np.testing.assert_allclose(feats, direct, atol=1e-5)
  # As the user runs it: vit-evaluate on the file, the layer's size read from it.
  path = str(tmp_path / 'with_pre_logits.npz')
  checkpoint.save_npz(path, params)
  args = dict(checkpoint=path, workdir=None, model='ViT-Ti_16',
              model_overrides=','.join(f'{k}={v}' for k, v in TINY.items()),
              dataset='fashion_mnist_local', data_dir=tiny['idx_dir'], image_size=28,
              eval_crop='resize', mode='fewshot', train_split='train', eval_split='test',
              shots=['1'], seeds=['0'], l2_reg=1.0, batch_size=8)
  table = evaluate_cli.run(types.SimpleNamespace(**args))
  assert table.splitlines()[-1].split()[1:3] == ['fashion_mnist_local', '1-shot'], table


def test_a_long_extraction_reports_its_progress(tiny, monkeypatch, caplog):
  monkeypatch.setattr(evaluate, 'PROGRESS_EVERY_S', 0)
  with caplog.at_level(logging.INFO):
    evaluate.extract_features(tiny['model'], tiny['params'], tiny['config'], 'test', batch_size=16)
  assert re.findall(r'features of (\d+) images so far', caplog.text) == ['16', '20']


@pytest.mark.parametrize('standardise', [True, False])
def test_evaluator_matches_pure_functions(tiny, standardise):
  config = tiny['config'].copy_and_resolve_references()
  config.fewshot_standardise = standardise
  fewshot = evaluate.FewShotEvaluator(config, tiny['model'])
  # Only the drawn k-shot images are cached: <= classes x max shots x seeds.
  cached = sum(int(b['mask'].sum()) for b in fewshot.tasks['fashion_mnist_local']._train_batches)
  assert 10 * 5 <= cached <= 10 * 5 * 2
  metrics = fewshot(tiny['params'])
  assert set(metrics) == {
      'fewshot/fashion_mnist_local/1shot', 'fewshot/fashion_mnist_local/5shot',
      'fewshot/mean/1shot', 'fewshot/mean/5shot'
  }
  tx, ty = evaluate.extract_features(tiny['model'], tiny['params'], config, 'train', 16)
  ex, ey = evaluate.extract_features(tiny['model'], tiny['params'], config, 'test', 16)
  ref = evaluate.fewshot_accuracy(tx, ty, ex, ey, 10, (1, 5), (0, 1), standardise=standardise)
  for k in (1, 5):
    assert metrics[f'fewshot/fashion_mnist_local/{k}shot'] == pytest.approx(
        ref[k]['mean'], abs=1e-6)
    assert metrics[f'fewshot/mean/{k}shot'] == metrics[f'fewshot/fashion_mnist_local/{k}shot']
  assert fewshot(tiny['params']) == metrics  # cached data, same answer


def test_fewshot_over_splits_smaller_than_one_batch(tiny):
  """At an eval batch larger than the pool (60) and the held-out split (20), eval_batches
  reads smaller batches; the k-shot draws still find their rows, and the answer is that
  of batch 16."""
  config = tiny['config'].copy_and_resolve_references()
  want = evaluate.FewShotEvaluator(config, tiny['model'])(tiny['params'])
  config.eval_batch_size = 512
  fewshot = evaluate.FewShotEvaluator(config, tiny['model'])
  task = fewshot.tasks['fashion_mnist_local']
  assert {len(b['mask']) for b in task._train_batches} == {64}
  assert [len(b['mask']) for b in task._eval_batches] == [24]
  got = fewshot(tiny['params'])
  assert got.keys() == want.keys()
  for k, v in want.items():
    assert got[k] == pytest.approx(v, abs=1e-6)


def test_library_and_inspect_load_no_evaluation_cli():
  """evaluate.py (the library) loads no CLI; vit-inspect loads neither it nor TensorFlow."""
  code = ('import sys; import vit_jax.{}; '
          'print(sorted(m for m in ("vit_jax.evaluate_cli", "tensorflow") if m in sys.modules))')
  loaded = [
      subprocess.run([sys.executable, '-c', code.format(module)], cwd=ROOT, capture_output=True,
                     text=True, timeout=120).stdout.strip() for module in ('evaluate', 'inspection')
  ]
  assert loaded == ["['tensorflow']", '[]']


def test_cli_end_to_end(tiny):
  cmd = [
      sys.executable, '-m', 'vit_jax.evaluate_cli', '--checkpoint', tiny['path'], '--model',
      'ViT-Ti_16', '--model_overrides', ','.join(f'{k}={v}' for k, v in TINY.items()), '--dataset',
      'fashion_mnist_local', '--data_dir', tiny['idx_dir'], '--image_size', '28', '--mode', 'all',
      '--shots', '1,5', '--seeds', '0,1', '--batch_size', '8'
  ]
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=2')
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.strip().splitlines()
  assert lines[0].split() == ['mode', 'metric', 'value']
  assert lines[1].startswith('top1') and '(20 images)' in lines[1]
  assert [l.split()[1:3] for l in lines[2:]] == [['fashion_mnist_local', '1-shot'],
                                                 ['fashion_mnist_local', '5-shot']]
  # A TFDS dataset not prepared: the one line, not TFDS's three "Constructing tf.data.Dataset"
  # lines above it (cli_help.quiet_the_libraries).
  data_dir = os.path.join(os.path.dirname(tiny['path']), 'tfds')
  cmd[cmd.index('fashion_mnist_local'):cmd.index('--image_size')] = [
      'cifar10', '--data_dir', data_dir
  ]
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert (out.returncode, out.stderr.strip().splitlines()) == (1, [
      f'vit-evaluate: dataset cifar10 is not prepared in data_dir {data_dir}: run `vit-tfds-build '
      f'cifar10 --data_dir={data_dir}` or set --data_dir to where it is prepared.'
  ]), out.stderr[-2000:]
  # Errors are one line naming the fix (in-process: the same code path as the CLI).
  args = dict(checkpoint=tiny['path'], model='ViT-Ti_16', model_overrides='num_layers=2,'
              'hidden_size=32,mlp_dim=64,num_heads=2,patch_size=7', dataset='fashion_mnist_local',
              data_dir=tiny['idx_dir'], image_size=28, eval_crop='resize', mode='top1',
              train_split='train', eval_split='test', shots=['1'], seeds=['0'], l2_reg=1.0,
              batch_size=3)
  with pytest.raises(ValueError, match='multiple of the 8 devices'):
    evaluate_cli.run(types.SimpleNamespace(**args))
  head_free = str(os.path.join(os.path.dirname(tiny['path']), 'nohead.npz'))
  checkpoint.save_npz(head_free, {k: v for k, v in tiny['params'].items() if k != 'head'})
  with pytest.raises(ValueError, match='use --mode fewshot'):
    evaluate_cli.run(types.SimpleNamespace(**{**args, 'checkpoint': head_free, 'batch_size': 8}))
  # A file that cannot be decoded is named in the row: it had left the denominator in silence.
  root = os.path.join(os.path.dirname(tiny['path']), 'ten')
  data_fixtures.write_folder(root, 'test', {f'c{i}': [i] for i in range(10)})
  data_fixtures.write_corrupt(os.path.join(root, 'test', 'c3', 'bad.png'))
  table = evaluate_cli.run(
      types.SimpleNamespace(**{
          **args, 'dataset': f'folder:{root}',
          'batch_size': 8
      }))
  assert table.splitlines()[1].endswith('(10 images; 1 undecodable image not counted)'), table


@pytest.mark.parametrize('lands_in', ['the evaluation', 'a __del__'])
def test_ctrl_c_is_one_line(tiny, lands_in):
  """Ctrl-C printed a page of traceback; landing in a garbage-collection callback (JAX has
  one) or a __del__, it was printed as "Exception ignored" and the evaluation went on."""
  interrupt = 'os.kill(os.getpid(), signal.SIGINT)'
  child = (CTRL_C_AS_IN_A_TERMINAL + 'import os, signal, sys\n'
           'from vit_jax import tensorflow_quietly, evaluate, evaluate_cli  # as run does\n'
           'top1 = evaluate.top1_accuracy\n'
           'class Freed:\n'
           f'  def __del__(self): {interrupt}\n'
           'def interrupted(*args):\n'
           f'  {interrupt if lands_in == "the evaluation" else "Freed()"}\n'
           '  return top1(*args)\n'
           'evaluate.top1_accuracy = interrupted\n'
           'sys.argv[0] = "vit-evaluate"\n'
           'evaluate_cli.run_cli()\n')
  cmd = [
      sys.executable, '-c', child, '--checkpoint', tiny['path'], '--model', 'ViT-Ti_16',
      '--model_overrides', ','.join(f'{k}={v}' for k, v in TINY.items()), '--dataset',
      'fashion_mnist_local', '--data_dir', tiny['idx_dir'], '--image_size', '28', '--mode', 'top1'
  ]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'))
  assert (out.returncode,
          out.stderr.strip().splitlines()) == (130, ['vit-evaluate: interrupted (Ctrl-C)'
                                                    ]), out.stderr[-2000:]
  assert not out.stdout


def test_cli_default_shots_skip_what_a_small_pool_cannot_draw(tiny, monkeypatch):
  """6 train images a class: the default shots 10 and 25 get a row saying why, the rest
  are evaluated; shots typed on the command line that do not fit, or bad values, stop with
  one line naming the fix."""
  cmd = [
      sys.executable, '-m', 'vit_jax.evaluate_cli', '--checkpoint', tiny['path'], '--model',
      'ViT-Ti_16', '--model_overrides', ','.join(f'{k}={v}' for k, v in TINY.items()), '--dataset',
      'fashion_mnist_local', '--data_dir', tiny['idx_dir'], '--image_size', '28', '--seeds', '0',
      '--batch_size', '8'
  ]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  rows = {l.split()[2]: l.split(None, 3)[3] for l in out.stdout.strip().splitlines()[1:]}
  assert list(rows) == ['1-shot', '5-shot', '10-shot', '25-shot']
  assert re.fullmatch(r'0\.\d{4}  \(seed 0\)', rows['5-shot'])  # one seed: no spread shown
  assert rows['10-shot'] == "skipped: class 0 (T-shirt/top) has 6 train images, fewer than 10"
  assert rows['25-shot'].endswith('fewer than 25')
  typed = subprocess.run(cmd + ['--shots', '1,10'], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
  assert typed.returncode == 1 and typed.stdout == ''
  assert typed.stderr.strip().splitlines()[-1] == (
      "vit-evaluate: fashion_mnist_local: class 0 (T-shirt/top) has 6 train images, fewer "
      'than 10 shots: use --shots=1 or a larger --train_split')
  # A held-out split the dataset lacks had been blamed on --train_split; k-shot flags beside
  # --mode top1 had been ignored.
  split = ("vit-evaluate: eval_split 'tset': Unknown split 'tset'. Should be one of ['train', "
           "'test']: set --eval_split")
  top1 = ('vit-evaluate: --shots, --seeds, --l2_reg only with --mode fewshot or all: --mode top1 '
          'draws no k-shot sets; drop them')
  typed = {
      split: ['--eval_split', 'tset'],
      top1: ['--mode', 'top1', '--shots', '5', '--l2_reg', '2']
  }
  for last, extra in typed.items():
    out = subprocess.run(cmd + extra, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stderr.strip().splitlines()[-1]) == (1, last), out.stderr[-2000:]
  args = dict(checkpoint=tiny['path'], model='ViT-Ti_16',
              model_overrides=','.join(f'{k}={v}' for k, v in TINY.items()),
              dataset='fashion_mnist_local', data_dir=tiny['idx_dir'], image_size=28,
              eval_crop='resize', mode='fewshot', train_split='train', eval_split='test',
              shots=['1'], seeds=['0'], l2_reg=1.0, batch_size=8)
  refusals = [
      (dict(shots=['1', 'five']), '--shots=1,five: expected whole numbers >= 1'),
      (dict(shots=['0']), '--shots=0: expected whole numbers >= 1'),
      (dict(seeds=['-1']), '--seeds=-1: expected whole numbers >= 0'),
      # One draw scored twice had read '0.7016 ± 0.0000'.
      (dict(seeds=['0', '0']), '--seeds=0,0 gives 0 twice: give each once'),
      (dict(shots=['5', '1', '5']), '--shots=5,1,5 gives 5 twice: give each once'),
      (dict(l2_reg=0.0), '--l2_reg=0.0 is not a positive number: use e.g. --l2_reg=1024'),
      (dict(l2_reg=math.inf), '--l2_reg=inf is not a positive number'),
      (dict(image_size=0), '--image_size=0: pass the resolution in pixels'),
      (dict(train_split='val'), "train_split 'val': Unknown split 'val'. Should be one of "
       "['train', 'test']: set --config.train_split"),  # the CLI names --train_split
      (dict(fewshot_datasets=['fashion_mnist_local', '']), '--fewshot_datasets=fashion_mnist_local'
       ',: a dataset name is empty: e.g. --fewshot_datasets=cifar100,oxford_iiit_pet'),
  ]
  for bad, message in refusals:
    with pytest.raises(ValueError, match='^' + re.escape(message)):
      evaluate_cli.run(types.SimpleNamespace(**{**args, **bad}))
  # Typed shots the pool cannot draw are refused from its labels, before any features: a
  # large folder's k-shot pool had been run through the model first.
  def no_features(*_, **__):
    raise AssertionError('features extracted before the shots were checked')

  monkeypatch.setattr(evaluate, 'extract_features', no_features)
  with pytest.raises(
      ValueError, match=r'^fashion_mnist_local: class 0 \(T-shirt/top\) has 6 '
      'train images, fewer than 10 shots: use --shots=1'):
    evaluate_cli.run(types.SimpleNamespace(**{**args, 'shots': ['1', '10']}))


def test_batch_defaults_to_the_runs_own_made_a_multiple_of_the_devices():
  none_given = types.SimpleNamespace(batch_size=None)
  run = {'eval_batch_size': 1000, 'fewshot_batch_size': None}
  assert evaluate_cli._batch_sizes(none_given, run, 8) == (1000, 1000)  # pylint: disable=protected-access
  assert evaluate_cli._batch_sizes(  # pylint: disable=protected-access
      none_given, {
          'eval_batch_size': 12,
          'fewshot_batch_size': 3
      }, 8) == (8, 8)
  assert evaluate_cli._batch_sizes(none_given, None, 8) == (64, 64)  # pylint: disable=protected-access
  assert evaluate_cli._batch_sizes(  # pylint: disable=protected-access
      types.SimpleNamespace(batch_size=16), run, 8) == (16, 16)


def test_mean_over_datasets_takes_the_shots_every_dataset_has():
  results = {'a': {1: {'mean': 0.5}, 5: {'mean': 0.7}}, 'b': {1: {'mean': 0.3}}}
  assert evaluate.mean_over_datasets(results) == {1: 0.4}
  assert evaluate.smallest_class([2, 2, 0, 1, 1, 0, 2]) == (0, 2)


# ------------------------------------------------------------- ImageNet ReaL
def test_top1_hits_on_label_sets_matches_numpy():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(12, 6))
  sets = [list(np.flatnonzero(rng.random(6) < 0.3)) for _ in range(12)]
  sets[3] = []
  hot = np.zeros((12, 6), np.float32)
  for i, s in enumerate(sets):
    hot[i, s] = 1.0
  mask = np.arange(12) < 10  # two padding rows
  correct, counted = evaluate.top1_hits(logits, hot, mask)
  used = [i for i in range(10) if sets[i]]
  np.testing.assert_array_equal(counted, [float(i in used) for i in range(12)])
  np.testing.assert_array_equal(
      correct, [float(i in used and np.argmax(logits[i]) in sets[i]) for i in range(12)])
  # A head wider than the sets' classes: a top-1 past them is a miss.
  wide = np.concatenate([logits, np.full((12, 1), 99.0)], 1)
  correct, counted = evaluate.top1_hits(wide, hot, mask)
  assert not correct.any() and counted.sum() == len(used)
  # Integer labels: top-1 equal to the label, every unmasked row counted.
  labels = rng.integers(0, 6, 12)
  correct, counted = evaluate.top1_hits(logits, labels, mask)
  np.testing.assert_array_equal(correct, (np.argmax(logits, -1) == labels) & mask)
  np.testing.assert_array_equal(counted, mask)


def test_cli_real_on_mocked_imagenet2012_real(tmp_path):
  """`vit-evaluate --dataset imagenet2012_real` (flags parsed as in the shell; TFDS mocked in
  the child process): top-1 counted in the ReaL sets, empty sets left out."""
  model = models.get_model('ViT-Ti_16', num_classes=1000, **TINY)
  params = model.init(jax.random.PRNGKey(1), jnp.zeros((1, 28, 28, 3)))['params']
  # A head that picks among classes 0-4, the classes of the sets: hits and misses both.
  bias = np.full(1000, -100.0, np.float32)
  bias[:5] = 0.0
  kernel = np.asarray(jax.random.normal(jax.random.PRNGKey(2), params['head']['kernel'].shape))
  params = {**params, 'head': {'kernel': kernel, 'bias': bias}}
  path = str(tmp_path / 'real.npz')
  checkpoint.save_npz(path, params)
  overrides = ','.join(f'{k}={v}' for k, v in TINY.items())
  args = [
      'vit-evaluate', '--checkpoint', path, '--model', 'ViT-Ti_16', '--model_overrides', overrides,
      '--dataset', 'imagenet2012_real', '--image_size', '28', '--batch_size', '8'
  ]
  child = ('import sys; from tests import data_fixtures; from vit_jax import evaluate_cli\n'
           f'sys.argv = {args!r} + sys.argv[1:]\n'
           'with data_fixtures.mock_real(37):\n  evaluate_cli.run_cli()')
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=2')
  out = subprocess.run([sys.executable, '-c', child], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  images = np.stack([data_fixtures.id_image(i) for i in range(37)])
  images = np.repeat(images[..., None], 3, -1).astype(np.float32) / 127.5 - 1
  top1 = np.argmax(np.asarray(model.apply({'params': params}, images)), -1)
  used = [i for i in range(37) if data_fixtures.label_set(i)]
  want = np.mean([top1[i] in data_fixtures.label_set(i) for i in used])
  lines = out.stdout.strip().splitlines()
  assert lines[1].split() == [
      'top1', 'validation', 'ReaL', f'{want:.4f}', f'({len(used)}', 'images', 'with', 'a', 'ReaL',
      'label)'
  ], lines
  assert len(used) == 35 and 0.2 < want < 0.8  # examples 0 and 32 have empty sets
  few = subprocess.run([sys.executable, '-c', child, '--mode', 'fewshot'], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert few.returncode == 1
  assert few.stderr.strip().splitlines()[-1] == (
      "vit-evaluate: imagenet2012_real holds only the ReaL labels of ImageNet's validation "
      'images, for top-1: use --mode top1')


# ------------------------------------------------------------- several datasets
def test_fewshot_over_two_datasets_reports_each_and_the_mean(tiny, tmp_path):
  """Fashion-MNIST-like IDX files and an image folder: per-dataset accuracies equal the pure
  functions on each dataset's features, and the mean is theirs; the CLI prints both, run
  from a shell in tmp_path with relative paths."""
  folder = tmp_path / 'shapes'
  data_fixtures.write_folder(str(folder), 'train', {
      c: list(range(100 + 10 * i, 106 + 10 * i)) for i, c in enumerate('abc')
  })
  data_fixtures.write_folder(str(folder), 'test', {
      c: list(range(200 + 10 * i, 204 + 10 * i)) for i, c in enumerate('abc')
  })
  config = tiny['config'].copy_and_resolve_references()
  config.fewshot_datasets = (('fashion_mnist_local', 'train', 'test'), (f'folder:{folder}', 'train',
                                                                        'test'))
  metrics = evaluate.FewShotEvaluator(config, tiny['model'])(tiny['params'])
  model, params = tiny['model'], tiny['params']
  for label, dataset, classes in (('fashion_mnist_local', 'fashion_mnist_local', 10),
                                  ('shapes', f'folder:{folder}', 3)):
    cfg = evaluate.data_config(config, dataset=dataset, split='test')
    tx, ty = evaluate.extract_features(model, params, cfg, 'train', 16)
    ex, ey = evaluate.extract_features(model, params, cfg, 'test', 16)
    ref = evaluate.fewshot_accuracy(tx, ty, ex, ey, classes, (1, 5), (0, 1), standardise=True)
    for k in (1, 5):
      assert metrics[f'fewshot/{label}/{k}shot'] == pytest.approx(ref[k]['mean'], abs=1e-6)
  for k in (1, 5):
    mean = (metrics[f'fewshot/fashion_mnist_local/{k}shot'] + metrics[f'fewshot/shapes/{k}shot'])
    assert metrics[f'fewshot/mean/{k}shot'] == pytest.approx(mean / 2, abs=1e-12)

  os.symlink(tiny['idx_dir'], tmp_path / 'idx')
  cmd = [
      'vit-evaluate', '--checkpoint', tiny['path'], '--model', 'ViT-Ti_16', '--model_overrides',
      ','.join(f'{k}={v}' for k, v in TINY.items()), '--data_dir', 'idx', '--image_size', '28',
      '--fewshot_datasets', 'fashion_mnist_local,folder:shapes', '--shots', '1,5', '--seeds', '0,1',
      '--batch_size', '8'
  ]
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=2',
             PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ['PATH'])
  out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  table = {' '.join(l.split()[1:3]): l.split()[3] for l in out.stdout.strip().splitlines()[1:]}
  assert list(table) == [
      'fashion_mnist_local 1-shot', 'fashion_mnist_local 5-shot', 'shapes 1-shot', 'shapes 5-shot',
      'mean 1-shot', 'mean 5-shot'
  ]
  for k in (1, 5):
    assert table[f'shapes {k}-shot'] == f'{metrics[f"fewshot/shapes/{k}shot"]:.4f}'
    assert table[f'mean {k}-shot'] == f'{metrics[f"fewshot/mean/{k}shot"]:.4f}'
