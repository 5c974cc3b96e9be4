r"""Evaluation of frozen models: top-1 accuracy (also ImageNet ReaL) and few-shot linear regression.

Few-shot linear evaluation (paper Section 4, Figure 4, Table 8): the pre-logit
representation of k images per class is frozen, and a regularised least-squares
regression from it to {-1, 1}^K targets is solved in closed form; accuracy is the
argmax of the regression on a held-out split. The paper leaves the solver's
details open; the choices here:
  - a bias term, NOT regularised (equivalent to centring features and targets);
  - the regulariser is `l2_reg * ||W||^2` on the sum (not mean) of squared errors,
    default 2**10; large values tend to the nearest-class-mean classifier, which is
    a safe place to be with 1-shot data;
  - optional standardisation (config.fewshot_standardise, on by default; the reason is
    in configs/common.py): each feature is centred and scaled by its mean and standard
    deviation over the k-shot training features, and the held-out features get the
    same map; a feature constant over the k-shot set is only centred;
  - the k-shot draw is a per-class random subset for each seed; draws are nested
    (the 5-shot set of a seed is part of its 10-shot set), accuracy is reported per
    seed and as the mean over seeds;
  - several datasets (config.fewshot_datasets): accuracy per dataset, and for each k
    the mean over the datasets, as the paper averages few-shot results (Fig. 4, Table 8).

Pure functions: fit_linear, predict, standardised, sample_k_shot, smallest_class, fewshot_accuracy.
Features come from extract_features; FewShotEvaluator caches images for periodic use
in training.

ImageNet ReaL (Beyer et al. 2020; the paper's "ReaL" column, Tables 2, 5, 6): TFDS
imagenet2012_real gives each validation image a set of plausible labels ('real_label');
top-1 is correct if it is in the set, and images whose set is empty are left out (the
count used is reported). `--dataset imagenet2012_real` selects it in the CLI (the
dataset exists only for this), config.eval_real in training.

The command line, vit-evaluate, is vit_jax/evaluate_cli.py.
"""
import functools
import math
import time

from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np

from vit_jax import config_checks
from vit_jax import data_sources
from vit_jax import errors
from vit_jax import input_pipeline
from vit_jax import sharding
from vit_jax.configs import common

# The defaults are those of every config (configs/common.py).
_DEFAULTS = common.get_config()
DEFAULT_L2_REG = _DEFAULTS.fewshot_l2_reg
DEFAULT_SHOTS = tuple(_DEFAULTS.fewshot_shots)
PROGRESS_EVERY_S = 30  # a progress line while features are extracted
DEFAULT_SEEDS = tuple(_DEFAULTS.fewshot_seeds)
DEFAULT_STANDARDISE = _DEFAULTS.fewshot_standardise
REAL_DATASET, REAL_SPLIT, REAL_LABEL_KEY = 'imagenet2012_real', 'validation', 'real_label'


# ------------------------------------------------------------ pure functions
def fit_linear(features, labels, num_classes, l2_reg=DEFAULT_L2_REG):
  """Ridge regression to {-1, 1} one-hot targets with an unregularised bias.

  Minimises ||X w + b - Y||^2 + l2_reg ||w||^2 in closed form, in float64.
  Centring X and Y removes the bias from the problem; the smaller of the primal
  (D x D) and dual (N x N) systems is solved.

  Args:
    features: [N, D] float.
    labels: [N] int in [0, num_classes).
    num_classes: K.
    l2_reg: the regulariser, > 0.

  Returns:
    (w [D, K], b [K]) as float64 arrays.
  """
  if l2_reg <= 0:
    raise ValueError(f'l2_reg {l2_reg} must be > 0: use e.g. {DEFAULT_L2_REG}')
  x = np.asarray(features, np.float64)
  labels = np.asarray(labels)
  _check_features_and_labels(x, labels, num_classes, 'features', 'labels')
  y = 2.0 * (labels[:, None] == np.arange(num_classes)[None, :]) - 1.0
  x_mean, y_mean = x.mean(0), y.mean(0)
  xc, yc = x - x_mean, y - y_mean
  n, d = xc.shape
  if n >= d:
    w = np.linalg.solve(xc.T @ xc + l2_reg * np.eye(d), xc.T @ yc)
  else:  # (X^T X + l I)^-1 X^T = X^T (X X^T + l I)^-1
    w = xc.T @ np.linalg.solve(xc @ xc.T + l2_reg * np.eye(n), yc)
  return w, y_mean - x_mean @ w


def predict(w, b, features):
  """Regression outputs [N, K]; the predicted class is their argmax."""
  return np.asarray(features, np.float64) @ w + b


def standardised(train_x, test_x):
  """(train_x, test_x) mapped by train_x's per-feature mean and standard deviation (a
  feature constant over train_x is only centred), in float64."""
  train_x, test_x = np.asarray(train_x, np.float64), np.asarray(test_x, np.float64)
  mean, std = train_x.mean(0), train_x.std(0)
  std = np.where(std > 0, std, 1.0)
  return (train_x - mean) / std, (test_x - mean) / std


def sample_k_shot(labels, k, seed, class_names=()):
  """Indices of k examples of each class present in `labels`, sorted.

  Deterministic in `seed`; nested in k (the first k of a per-class permutation).
  `class_names` (index i names label i) only make an error message clearer.
  """
  labels = np.asarray(labels)
  rng = np.random.default_rng(seed)
  picked = []
  for c in np.unique(labels):
    members = np.flatnonzero(labels == c)
    if len(members) < k:
      name = f' ({class_names[c]})' if c < len(class_names) else ''
      raise ValueError(f'Class {c}{name} has {len(members)} examples, fewer than {k} shots: '
                       'use a larger few-shot train split or fewer shots')
    picked.append(members[rng.permutation(len(members))[:k]])
  return np.sort(np.concatenate(picked))


def _check_features_and_labels(x, labels, num_classes, x_name, labels_name):
  """[N, D] features and N labels in [0, num_classes), or a ValueError naming the fault (a
  label past the classes had been scored as a class the fit cannot predict)."""
  if x.ndim != 2 or labels.ndim != 1 or len(x) != len(labels):
    raise ValueError(f'{x_name} {x.shape} and {labels_name} {labels.shape}: expected [N, D] '
                     'features and N integer labels')
  if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
    raise ValueError(f'{labels_name} run from {labels.min()} to {labels.max()}, outside the '
                     f'{num_classes} classes 0..{num_classes - 1}: pass the number of classes')


def fewshot_accuracy(train_x, train_y, test_x, test_y, num_classes, shots=DEFAULT_SHOTS,
                     seeds=DEFAULT_SEEDS, l2_reg=DEFAULT_L2_REG, draw=None,
                     standardise=DEFAULT_STANDARDISE):
  """Few-shot linear accuracy for each k in `shots`.

  The k-shot training set is drawn from (train_x, train_y) for each seed, by
  `draw(k, seed) -> indices` (default: sample_k_shot(train_y, k, seed)); the
  regression is scored on all of (test_x, test_y). `standardise`: features mapped by
  standardised() from each k-shot set before the fit. The defaults are those of the
  configs (configs/common.py fewshot_*), so a call reproduces vit-evaluate's figures.

  Returns:
    {k: {'mean': float, 'std': float, 'per_seed': [float, ...]}}.
  """
  train_x, train_y = np.asarray(train_x), np.asarray(train_y)
  test_x, test_y = np.asarray(test_x), np.asarray(test_y)
  _check_features_and_labels(train_x, train_y, num_classes, 'train_x', 'train_y')
  _check_features_and_labels(test_x, test_y, num_classes, 'test_x', 'test_y')
  if train_x.shape[1] != test_x.shape[1]:
    raise ValueError(f'train_x has {train_x.shape[1]} features per example, test_x '
                     f'{test_x.shape[1]}: extract both with the same model')
  draw = draw or (lambda k, seed: sample_k_shot(train_y, k, seed))
  out = {}
  for k in shots:
    accs = []
    for seed in seeds:
      idx = draw(k, seed)
      fit_x, eval_x = (standardised(train_x[idx], test_x) if standardise else
                       (train_x[idx], test_x))
      w, b = fit_linear(fit_x, train_y[idx], num_classes, l2_reg)
      accs.append(float(np.mean(np.argmax(predict(w, b, eval_x), -1) == test_y)))
    out[k] = {'mean': float(np.mean(accs)), 'std': float(np.std(accs)), 'per_seed': accs}
  return out


def top1_hits(logits, labels, mask):
  """(correct, counted), float per row: the one top-1 rule of training and the CLI.

  labels: int [N] classes, or multi-hot [N, K] sets (e.g. ReaL), where the top-1 class
  is correct if it is in the set and a row with an empty set is not counted (a head
  wider than K: its extra classes are in no set).
  mask: bool [N], False on padding.
  """
  top1 = jnp.argmax(logits, -1)
  if labels.ndim == 2:
    labels = jnp.pad(labels, ((0, 0), (0, logits.shape[-1] - labels.shape[-1])))
    correct = jnp.take_along_axis(labels, top1[:, None], axis=-1)[:, 0] > 0
    mask = mask & (jnp.max(labels, axis=-1) > 0)
  else:
    correct = top1 == labels
  mask = mask.astype(jnp.float32)
  return correct.astype(jnp.float32) * mask, mask


def mean_over_datasets(results):
  """{name: {k: {'mean': ...}}} -> {k: mean over the datasets of their mean accuracy}, for
  the k that every dataset has."""
  shots = [k for k in next(iter(results.values())) if all(k in r for r in results.values())]
  return {k: float(np.mean([r[k]['mean'] for r in results.values()])) for k in shots}


def smallest_class(labels):
  """(label, count) of the class with the fewest examples in `labels` (non-empty): the
  largest k of a k-shot draw from them (sample_k_shot)."""
  classes, counts = np.unique(np.asarray(labels), return_counts=True)
  i = int(np.argmin(counts))
  return int(classes[i]), int(counts[i])


# ------------------------------------------------------------- data & models
def real_config(config):
  """A copy of `config` whose evaluation split is ImageNet ReaL (imagenet2012_real
  'validation', labels the 'real_label' sets)."""
  c = ml_collections.ConfigDict(config.to_dict())
  c.dataset, c.eval_split, c.label_key = REAL_DATASET, REAL_SPLIT, REAL_LABEL_KEY
  return c


def data_config(config, *, dataset=None, data_dir=None, split):
  """A copy of `config` (a full config, configs/common.py) whose evaluation split is
  `split` of `dataset` in `data_dir` (None: the config's). Another dataset is read with
  its own class feature (the default label_key), not the run's."""
  c = ml_collections.ConfigDict(config.to_dict())
  if dataset and dataset != c.dataset:
    c.dataset, c.label_key = dataset, _DEFAULTS.label_key
  if data_dir:
    c.data_dir = data_dir
  c.eval_split = c.train_split = split
  return c


@functools.partial(jax.jit, static_argnums=0)  # modules hash by their fields
def _apply(model, params, images):
  _, state = model.apply({'params': params}, images, train=False, mutable=['intermediates'])
  return state['intermediates']['representation'][0]


def apply_fn(model):
  """jitted (params, images) -> pre-logit features."""
  return functools.partial(_apply, model)


def _run_batches(fn, params, batches, mesh):
  """Features, labels (and 'row's) of the valid rows of host-local `batches`, all hosts."""
  batch_sharding = sharding.data_sharding(mesh)
  feats, labels, rows = [], [], []
  start = reported = time.monotonic()
  for batch in batches:
    images = input_pipeline.to_global({'image': batch['image']}, batch_sharding)['image']
    ok = multihost_utils.process_allgather(batch['mask'], tiled=True)
    feats.append(multihost_utils.process_allgather(fn(params, images), tiled=True)[ok])
    if time.monotonic() - reported > PROGRESS_EVERY_S:  # a long split is not silence
      reported = time.monotonic()
      logging.info('features of %d images so far (%.0f s)', sum(len(f) for f in feats),
                   reported - start)
    labels.append(multihost_utils.process_allgather(batch['label'], tiled=True)[ok])
    if 'row' in batch:
      rows.append(multihost_utils.process_allgather(batch['row'], tiled=True)[ok])
  if not feats:
    raise ValueError('No batches were read: the split is empty; choose another split')
  out = (np.concatenate(feats).astype(np.float32), np.concatenate(labels))
  return out + (np.concatenate(rows),) if rows else out


def _check_batch(batch_size, mesh):
  n = mesh.devices.size
  if batch_size <= 0 or batch_size % n:
    raise ValueError(f'Batch size {batch_size} is not a positive multiple of the {n} devices: '
                     'set the batch size (e.g. --batch_size) to a multiple of it')


def extract_features(model, params, config, split, batch_size):
  """(features [N, D] float32, labels [N]) of every image of `split`, in order.

  Reads config.dataset / data_dir / image_size / pp through input_pipeline.eval_batches;
  padding and undecodable images (mask False) are dropped. On several hosts every
  host returns the whole split.
  """
  mesh = sharding.make_mesh(config)
  _check_batch(batch_size, mesh)
  cfg = data_config(config, split=split)
  return _run_batches(apply_fn(model), params,
                      input_pipeline.eval_batches(cfg, global_batch=batch_size), mesh)


def top1_step(model, head_index=None):
  """(params, global batch) -> {'correct', 'count'} of the batch (top1_hits); to be jitted.

  head_index: int [K], the head's class of the data's label k, where the data names its
  classes otherwise than the head (a held-out folder of some of the run's classes);
  None: label k is the head's class k.
  """

  def step(params, batch):
    logits = model.apply({'params': params}, batch['image'], train=False)
    labels = batch['label'] if head_index is None else jnp.asarray(head_index)[batch['label']]
    correct, counted = top1_hits(logits, labels, batch['mask'])
    return {'correct': jnp.sum(correct), 'count': jnp.sum(counted)}

  return step


def accuracy_over_split(eval_step, params, config, batch_sharding, check_labels=None):
  """(correct / count, count, undecodable) summed over every batch of config.eval_split (all
  hosts): `undecodable` images were left out of the count.

  eval_step: jitted (params, global batch) -> replicated {'correct', 'count'} (top1_step,
  or the masked-patch objective's). check_labels: called with each batch's valid host
  labels before the step.
  """
  correct = count = 0.0
  batches = input_pipeline.eval_batches(config, global_batch=config.eval_batch_size)
  for batch in batches:
    if check_labels is not None:
      check_labels(batch['label'][batch['mask']])
    out = eval_step(params, input_pipeline.to_global(batch, batch_sharding))
    # Replicated: every device holds the sums (several hosts: not all addressable).
    correct += float(np.asarray(out['correct'].addressable_data(0)))
    count += float(np.asarray(out['count'].addressable_data(0)))
  undecodable = int(np.sum(multihost_utils.process_allgather(np.int64(batches.skipped))))
  return correct / max(count, 1.0), int(count), undecodable


def not_counted(undecodable):
  """'; <k> undecodable image(s) not counted', or '' where there were none: they had left
  the accuracy's denominator with only an earlier warning to say so."""
  return f'; {errors.count_of(undecodable, "undecodable image")} not counted' if undecodable else ''


def top1_accuracy(model, params, config, split, batch_size, head_index=None):
  """(accuracy, examples counted, undecodable images left out) of the model's head on
  `split` (top1_hits; head_index as top1_step's)."""
  if not model.num_classes:
    raise ValueError('The model has no head: use few-shot evaluation (--mode fewshot)')
  mesh = sharding.make_mesh(config)
  _check_batch(batch_size, mesh)
  cfg = data_config(config, split=split)
  cfg.eval_batch_size = batch_size
  step = jax.jit(top1_step(model, head_index),
                 in_shardings=(sharding.replicated(mesh), sharding.data_sharding(mesh)),
                 out_shardings=sharding.replicated(mesh))
  return accuracy_over_split(step, params, cfg, sharding.data_sharding(mesh))


# --------------------------------------------------------------- evaluator
class FewShotEvaluator:
  """Few-shot linear accuracy of a model's current parameters, for the train loop.

    fewshot = FewShotEvaluator(config, model)   # reads the data once
    metrics = fewshot(params)
    # {'fewshot/<dataset>/<k>shot': mean over seeds, 'fewshot/mean/<k>shot': over datasets}

  One _FewShotTask per entry of config.fewshot_datasets (config_checks.fewshot_tasks);
  the fields read are the fewshot_* ones of configs/common.py, plus image_size, pp,
  eval_batch_size, mesh_data.
  """

  def __init__(self, config, model):
    fn = apply_fn(model)
    self.tasks = {
        label: _FewShotTask(config, fn, dataset, train_split, eval_split)
        for label, dataset, train_split, eval_split in config_checks.fewshot_tasks(config)
    }

  def descriptions(self):
    """A line per dataset: its splits, classes, shots, seeds and regulariser (for the log)."""
    return [task.description for task in self.tasks.values()]

  def results(self, params):
    """{label: fewshot_accuracy(...) of that dataset}."""
    return {label: task(params) for label, task in self.tasks.items()}

  def __call__(self, params):
    results = self.results(params)
    metrics = {
        f'fewshot/{label}/{k}shot': r['mean'] for label, per_k in results.items()
        for k, r in per_k.items()
    }
    metrics.update({f'fewshot/mean/{k}shot': acc for k, acc in mean_over_datasets(results).items()})
    return metrics


def _task_configs(config, dataset, train_split, eval_split):
  """The data configs of a few-shot task's k-shot pool and held-out split."""
  data_dir = config.fewshot_data_dir or config.data_dir
  return tuple(
      data_config(config, dataset=dataset, data_dir=data_dir, split=split)
      for split in (train_split, eval_split))


def check_fewshot_data(config):
  """Start-up check that every few-shot dataset and split can be read: one line naming
  the entry of config.fewshot_datasets, before the workdir is made (else a traceback at
  the first few-shot evaluation's set-up)."""
  for label, dataset, train_split, eval_split in config_checks.fewshot_tasks(config):
    cfgs = _task_configs(config, dataset, train_split, eval_split)
    for cfg, field, what in zip(cfgs, ('train_split', 'eval_split'),
                                ('k-shot pool split', 'held-out split')):
      try:
        input_pipeline.count_split(cfg, field, f'fewshot_datasets {label} {what}',
                                   'fewshot_datasets')
      except data_sources.NotPrepared as e:  # its fix is not the run's own data_dir
        raise e.said_of(
            f'fewshot_datasets {label}', 'set --config.fewshot_data_dir to where it is prepared '
            '(or leave it out of --config.fewshot_datasets)') from None


class _FewShotTask:
  """The few-shot evaluation of one dataset.

  At construction it reads the k-shot pool split twice (labels, then the images of
  the drawn k-shot examples only: classes x max(shots) x seeds at most) and keeps
  the held-out images in memory if they fit in `fewshot_cache_mb`. Each call then
  only runs the model on cached images (the held-out split is re-read when too big).
  """

  def __init__(self, config, fn, dataset, train_split, eval_split):
    self._fn = fn
    self.shots = tuple(int(k) for k in config.fewshot_shots)
    self.seeds = tuple(int(s) for s in config.fewshot_seeds)
    self.l2_reg = float(config.fewshot_l2_reg)
    self.standardise = bool(config.fewshot_standardise)
    self.batch_size = int(config.fewshot_batch_size or config.eval_batch_size)
    self.mesh = sharding.make_mesh(config)
    _check_batch(self.batch_size, self.mesh)
    self._train_cfg, self._eval_cfg = _task_configs(config, dataset, train_split, eval_split)
    info = input_pipeline.get_info(self._eval_cfg)
    if info.multi_label:
      raise ValueError(f'few-shot dataset {dataset} has label sets: use a single-label dataset '
                       '(or its label_key) in --config.fewshot_datasets')
    self.num_classes = info.num_classes
    self._train_batches = self._kshot_batches()
    nbytes = info.num_eval_examples * 3 * 4 * self._eval_cfg.image_size**2
    self._eval_batches = None
    if nbytes <= float(config.fewshot_cache_mb) * 2**20:
      self._eval_batches = list(self._read(self._eval_cfg))
    self.description = (f'few-shot: {dataset} {train_split} -> {eval_split}, '
                        f'{self.num_classes}-way, shots {self.shots}, seeds {self.seeds}, '
                        f'l2_reg {self.l2_reg:g}' + (', standardised' if self.standardise else ''))

  def _read(self, cfg):
    return input_pipeline.eval_batches(cfg, global_batch=self.batch_size)

  def _kshot_batches(self):
    """Local batches holding only the pool examples that some (k, seed) draw uses.

    Each kept example carries 'row', its index among the pool's valid examples, so
    that a call fits on exactly the rows sample_k_shot draws from the whole pool.
    """
    labels, masks = [], []
    for batch in self._read(self._train_cfg):  # pass 1: labels (of all hosts)
      local = len(batch['label'])  # the host batch eval_batches chose for this split
      labels.append(multihost_utils.process_allgather(batch['label'], tiled=True))
      masks.append(multihost_utils.process_allgather(batch['mask'], tiled=True))
    labels, masks = np.concatenate(labels), np.concatenate(masks)
    self._pool_labels = labels[masks]
    row_of = np.cumsum(masks) - 1  # stream position -> valid-row index
    names = input_pipeline.class_names(self._train_cfg)
    self._draws = {
        (k, s): sample_k_shot(self._pool_labels, k, s, names) for k in self.shots for s in self.seeds
    }
    keep = np.zeros(len(labels), bool)
    keep[np.flatnonzero(masks)[np.concatenate(list(self._draws.values()))]] = True
    # The gathered stream is batch-major: [batch, host, local row].
    hosts, host = jax.process_count(), jax.process_index()
    by_host = lambda a: a.reshape(-1, hosts, local).transpose(1, 0, 2).reshape(hosts, -1)
    keep_hosts = by_host(keep)
    mine, my_rows = keep_hosts[host], by_host(row_of)[host]
    images, kept_labels, pos = [], [], 0
    for batch in self._read(self._train_cfg):  # pass 2: keep the drawn images
      sel = mine[pos:pos + len(batch['label'])]
      images.append(batch['image'][sel])
      kept_labels.append(batch['label'][sel])
      pos += len(batch['label'])
    images, kept_labels = np.concatenate(images), np.concatenate(kept_labels)
    kept_rows = my_rows[mine]
    num_batches = math.ceil(keep_hosts.sum(1).max() / local)  # same on every host
    out = []
    for i in range(num_batches):
      part = slice(i * local, (i + 1) * local)
      im, lb, rw = images[part], kept_labels[part], kept_rows[part]
      pad = local - len(lb)
      out.append({
          'image': np.concatenate([im, np.zeros((pad, *im.shape[1:]), im.dtype)]),
          'label': np.concatenate([lb, np.zeros(pad, lb.dtype)]),
          'row': np.concatenate([rw, np.zeros(pad, rw.dtype)]),
          'mask': np.arange(local) < len(lb)
      })
    return out

  def __call__(self, params):
    """fewshot_accuracy(...) of `params` on this dataset: {k: {'mean', 'std', 'per_seed'}}."""
    train_x, train_y, rows = _run_batches(self._fn, params, self._train_batches, self.mesh)
    position = np.full(len(self._pool_labels), -1)
    position[rows] = np.arange(len(rows))
    eval_batches = self._eval_batches or self._read(self._eval_cfg)
    test_x, test_y = _run_batches(self._fn, params, eval_batches, self.mesh)
    return fewshot_accuracy(train_x, train_y, test_x, test_y, self.num_classes, self.shots,
                            self.seeds, self.l2_reg, draw=lambda k, seed: position[self._draws[
                                (k, seed)]], standardise=self.standardise)
