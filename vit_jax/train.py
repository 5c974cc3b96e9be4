"""One training loop for pre-training (Table 3) and fine-tuning (Table 4).

The two differ in config only. The step is jitted over a 1-D device mesh with explicit
shardings (data parallel, or FSDP with `config.fsdp`); batches arrive as global
jax.Arrays. The state is {'step', 'params', 'opt_state'}; everything random in step s
(data order, augmentation, dropout) is a function of (seed, s), so a run resumed from
its orbax checkpoint continues exactly where it stopped.
"""
import os
import signal
import threading
import time

from absl import logging
from clu import metric_writers
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import optax
import tensorflow as tf

from vit_jax import checkpoint
from vit_jax import evaluate as evaluate_lib
from vit_jax import input_pipeline
from vit_jax import models
from vit_jax import optim
from vit_jax import paths
from vit_jax import sharding

DTYPES = ('float32', 'bfloat16')
# VTAB-1k tasks whose label is computed from other features (configs/finetune.py).
_DERIVED_LABEL_TASKS = ('clevr_count', 'clevr_distance', 'dsprites_location',
                        'dsprites_orientation', 'kitti_distance', 'smallnorb_azimuth',
                        'smallnorb_elevation')


class ConfigError(ValueError):
  """A bad config or data source found at start-up; main prints it as one line."""


def build_model(config, num_classes):
  return models.get_model(config.model_name, num_classes, dtype=config.dtype,
                          remat=config.remat, head_bias_init=config.head_bias_init,
                          **config.model)


def _stride(config):
  """Pixels per token side: patch size times the hybrid stem's downsampling."""
  fields = models.get_variant(config.model_name, **config.model)
  if fields['family'] != 'vit':
    return 1
  layers = fields['resnet_layers']
  stem = 1 if layers is None else 4 * 2**max(len(layers) - 1, 0)
  return stem * fields['patch_size']


def validate_config(config, num_train_examples=None):
  """Start-up checks; each failure is one line naming the field and the fix."""
  if config.dtype not in DTYPES:
    raise ValueError(f'dtype {config.dtype!r} is unknown: set --config.dtype to one of {DTYPES}')
  stride = _stride(config)
  if config.image_size % stride:
    raise ValueError(f'image_size {config.image_size} is not divisible by patch size {stride}: '
                     f'set --config.image_size to a multiple of {stride}')
  n_dev = jax.device_count() if config.mesh_data == -1 else config.mesh_data
  micro = config.batch_size // max(config.accum_steps, 1)
  if config.batch_size % max(config.accum_steps, 1) or micro % n_dev:
    raise ValueError(f'batch_size {config.batch_size} / accum_steps {config.accum_steps} must be a '
                     f'multiple of the {n_dev} devices: set --config.batch_size')
  if config.eval_batch_size % n_dev:
    raise ValueError(f'eval_batch_size {config.eval_batch_size} is not a multiple of the {n_dev} '
                     'devices: set --config.eval_batch_size')
  if config.vtab_task in _DERIVED_LABEL_TASKS:
    raise ValueError(f'vtab_task {config.vtab_task!r} needs labels derived from other features, '
                     'which the input pipeline does not do yet: choose another VTAB task')
  fields = models.get_variant(config.model_name, **config.model)
  if config.pretrained_keep_prelogits and fields.get('representation_size') is None:
    raise ValueError('pretrained_keep_prelogits needs the pre-logits layer in the model: set '
                     '--config.model.representation_size to the checkpoint\'s size')
  optim.validate(config, num_train_examples)


def per_example_loss(logits, labels, kind):
  """Softmax cross-entropy, or sigmoid cross-entropy summed over classes (multi-label)."""
  onehot = jax.nn.one_hot(labels, logits.shape[-1])
  if kind == 'sigmoid_xent':
    return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, onehot), axis=-1)
  return -jnp.sum(onehot * jax.nn.log_softmax(logits), axis=-1)


def make_train_step(model, tx, schedule, config, mesh):
  """(state, batch, rng) -> (state, metrics); `accum_steps` micro-batches per step."""
  accum = config.accum_steps

  def grads(params, images, labels, rng):
    def loss(p):
      logits = model.apply({'params': p}, images, train=True, rngs={'dropout': rng})
      return jnp.mean(per_example_loss(logits, labels, config.loss))
    return jax.value_and_grad(loss)(params)

  def step(state, batch, rng):
    params = state['params']
    rng = jax.random.fold_in(rng, state['step'])
    if accum == 1:
      loss, g = grads(params, batch['image'], batch['label'], rng)
    else:
      # Micro-batch j takes rows j, j+accum, ...: every device keeps its own rows.
      def split(x):
        x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
        spec = jax.sharding.PartitionSpec(None, sharding.DATA)
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))

      def body(carry, xs):
        j, images, labels = xs
        loss_j, g_j = grads(params, images, labels, jax.random.fold_in(rng, j))
        return jax.tree.map(jnp.add, carry, (loss_j, g_j)), None

      zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
      (loss, g), _ = jax.lax.scan(
          body, zeros, (jnp.arange(accum), split(batch['image']), split(batch['label'])))
      loss, g = jax.tree.map(lambda x: x / accum, (loss, g))
    updates, opt_state = tx.update(g, state['opt_state'], params)
    new_state = {'step': state['step'] + 1, 'params': optax.apply_updates(params, updates),
                 'opt_state': opt_state}
    metrics = {'loss': loss, 'grad_norm': optax.global_norm(g), 'lr': schedule(state['step'])}
    return new_state, metrics

  return step


def make_eval_step(model):
  def step(params, batch):
    logits = model.apply({'params': params}, batch['image'], train=False)
    mask = batch['mask'].astype(jnp.float32)
    correct = (jnp.argmax(logits, -1) == batch['label']).astype(jnp.float32)
    return {'correct': jnp.sum(correct * mask), 'count': jnp.sum(mask)}
  return step


def evaluate(eval_step, params, config, batch_sharding):
  """Top-1 accuracy over the whole evaluation split (padding masked out)."""
  correct = count = 0.0
  for batch in input_pipeline.eval_batches(config, global_batch=config.eval_batch_size):
    out = _local(eval_step(params, input_pipeline.to_global(batch, batch_sharding)))
    correct += float(out['correct'])
    count += float(out['count'])
  return correct / max(count, 1.0), int(count)


def _local(tree):
  """Host values of replicated arrays (on several hosts they are not fully addressable)."""
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def _initial_params(config, model, num_classes, param_shardings):
  if config.pretrained_path:
    params = checkpoint.load_pretrained(config.pretrained_path, model, num_classes,
                                        config.image_size, head_bias_init=config.head_bias_init)
    return jax.device_put(params, param_shardings)
  images = jnp.zeros((1, config.image_size, config.image_size, 3), jnp.float32)
  init = jax.jit(lambda rng: model.init(rng, images, train=False)['params'],
                 out_shardings=param_shardings)
  return init(jax.random.PRNGKey(config.seed))


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _write_config(config, workdir):
  if jax.process_index() == 0:
    with tf.io.gfile.GFile(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(config.to_json_best_effort(indent=2))


def train_and_evaluate(config, workdir, *, stop_after_steps=None):
  """Trains `config` in `workdir`, resuming from its latest checkpoint; returns metrics.

  `stop_after_steps` ends the run early at that step (with a checkpoint), as a
  preemption would, without changing the schedule. A local `workdir` may be relative.
  """
  workdir = paths.resolve(workdir)  # orbax refuses relative checkpoint paths
  try:
    info = input_pipeline.get_info(config)
    num_classes = config.num_classes if config.num_classes > 0 else info.num_classes
    validate_config(config, info.num_train_examples)
    total_steps = optim.total_steps(config, info.num_train_examples)
    schedule = optim.learning_rate_schedule(config, total_steps)
    tx = optim.make_optimizer(config, total_steps)
    model = build_model(config, num_classes)
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(str(e)) from None
  tf.io.gfile.makedirs(workdir)  # local or gs://

  mesh = sharding.make_mesh(config)
  batch_sharding = sharding.data_sharding(mesh)
  replicated = sharding.replicated(mesh)
  images = jax.ShapeDtypeStruct((1, config.image_size, config.image_size, 3), jnp.float32)
  abstract_params = jax.eval_shape(
      lambda x: model.init(jax.random.PRNGKey(0), x, train=False)['params'], images)
  param_sh = sharding.tree_shardings(abstract_params, mesh, config.fsdp)
  opt_sh = sharding.tree_shardings(jax.eval_shape(tx.init, abstract_params), mesh, config.fsdp)
  state_sh = {'step': replicated, 'params': param_sh, 'opt_state': opt_sh}

  manager = checkpoint.train_state_manager(os.path.join(workdir, 'checkpoints'),
                                           config.keep_checkpoints)
  abstract_state = _abstract(
      {'step': jax.ShapeDtypeStruct((), jnp.int32), 'params': abstract_params,
       'opt_state': jax.eval_shape(tx.init, abstract_params)}, state_sh)
  state = checkpoint.restore_train_state(manager, abstract_state)
  if state is None:
    params = _initial_params(config, model, num_classes, param_sh)
    state = {'step': jax.device_put(jnp.int32(0), replicated), 'params': params,
             'opt_state': jax.jit(tx.init, out_shardings=opt_sh)(params)}
  start = int(_local(state['step']))
  if start:
    logging.info('Resuming from the checkpoint of step %d in %s', start, workdir)
  _write_config(config, workdir)

  train_step = jax.jit(make_train_step(model, tx, schedule, config, mesh),
                       in_shardings=(state_sh, batch_sharding, replicated),
                       out_shardings=(state_sh, replicated), donate_argnums=(0,))
  eval_step = jax.jit(make_eval_step(model), in_shardings=(param_sh, batch_sharding),
                      out_shardings=replicated)
  writer = metric_writers.create_default_writer(workdir, just_logging=jax.process_index() > 0)
  if start == 0:
    writer.write_hparams({k: v for k, v in config.to_dict().items()
                          if isinstance(v, (int, float, str, bool))})

  batches = input_pipeline.prefetch_to_mesh(
      input_pipeline.train_batches(config, global_batch=config.batch_size, start_step=start),
      batch_sharding, config.prefetch)
  fewshot = evaluate_lib.FewShotEvaluator(config, model) if config.fewshot_every_steps else None
  rng = jax.random.PRNGKey(config.seed)
  last = total_steps if stop_after_steps is None else min(stop_after_steps, total_steps)
  result = {'step': start}
  t_mark, s_mark = None, start
  preemption = _Preemption()
  try:
    for step in range(start + 1, last + 1):
      state, metrics = train_step(state, next(batches), rng)
      if t_mark is None:  # the first step compiled: time from its end
        jax.block_until_ready(metrics)
        t_mark, s_mark = time.perf_counter(), step
      if step % config.log_every_steps == 0 or step == last:
        metrics = _local(metrics)
        elapsed = time.perf_counter() - t_mark
        rate = (step - s_mark) * config.batch_size / elapsed if step > s_mark else float('nan')
        eta = (total_steps - step) * config.batch_size / rate if rate == rate and rate > 0 else 0.0
        per_core = rate / jax.device_count()
        logging.info('step %d/%d  loss %.4f  lr %.3g  %.1f img/s/core  ETA %s', step, total_steps,
                     metrics['loss'], metrics['lr'], per_core, _hms(eta))
        writer.write_scalars(step, {**{k: float(v) for k, v in metrics.items()},
                                    'img_per_sec_per_core': per_core})
        result.update(step=step, loss=float(metrics['loss']))
      if (config.eval_every_steps and step % config.eval_every_steps == 0) or step == total_steps:
        accuracy, n = evaluate(eval_step, state['params'], config, batch_sharding)
        logging.info('step %d  %s top-1 accuracy %.4f (%d examples)', step, config.eval_split,
                     accuracy, n)
        writer.write_scalars(step, {'accuracy': accuracy})
        result.update(accuracy=accuracy)
      if fewshot and (step % config.fewshot_every_steps == 0 or step == total_steps):
        scores = fewshot(state['params'])
        logging.info('step %d  few-shot linear: %s', step,
                     '  '.join(f'{k.split("/")[1]} {v:.4f}' for k, v in scores.items()))
        writer.write_scalars(step, scores)
        result.update(scores)
      result['step'] = step
      preempted = preemption.reached(step)
      if preempted or step % config.checkpoint_every_steps == 0 or step == last:
        checkpoint.save_train_state(manager, step, state, force=True)
      if preempted:
        logging.warning('Preempted at step %d: checkpoint saved; the next start resumes there',
                        step)
        result['preempted'] = True
        break
  finally:
    preemption.close()
  manager.wait_until_finished()
  writer.flush()
  finished = result['step'] == total_steps
  if finished and 'accuracy' not in result:  # a finished run, started again
    result['accuracy'], _ = evaluate(eval_step, state['params'], config, batch_sharding)
  if finished:
    # Collective under FSDP or on several hosts; only process 0 writes the file.
    params = multihost_utils.process_allgather(state['params'], tiled=True)
    if jax.process_index() == 0:
      checkpoint.save_npz(os.path.join(workdir, 'final.npz'), params)
    logging.info('Final %s top-1 accuracy: %.4f after %d steps (parameters: %s)',
                 config.eval_split, result['accuracy'], total_steps,
                 os.path.join(workdir, 'final.npz'))
  result['params'] = state['params']
  return result


class _Preemption:
  """SIGTERM (what a preempted TPU VM receives) -> stop at a step every host agrees on.

  One process: a Python handler sets a flag checked after each step. Several: JAX's
  preemption sync manager (set up by jax.distributed.initialize, notified of SIGTERM)
  picks the step, so all hosts save the same one.
  """

  def __init__(self):
    self.requested = False
    self._previous = None
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum, frame):
    del signum, frame
    logging.warning('SIGTERM: saving a checkpoint after this step, then exiting')
    self.requested = True

  def reached(self, step):
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.requested

  def close(self):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def _hms(seconds):
  seconds = int(seconds)
  return f'{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'
