"""The train step module: its loss, and that it loads without the input pipeline's TensorFlow."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from vit_jax import step as step_lib
from vit_jax.models import accelerator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_step_module_does_not_import_tensorflow():
  # benchmarks/bare_step.py measures the step's memory in a process without TF (~0.45 GiB).
  code = ('import sys; sys.path.insert(0, "benchmarks"); import bare_step; '
          'print(sorted(m for m in ("tensorflow", "tensorboard") if m in sys.modules))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True,
                       cwd=REPO)
  assert out.stdout.strip() == '[]', out.stdout


def _log_sigmoid(x):
  return -np.logaddexp(0.0, -x)


@pytest.mark.parametrize('kind', ['sigmoid_xent', 'softmax_xent'])
def test_multi_hot_loss_matches_numpy(kind):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(4, 6)) * 3
  sets = [[1, 3], [], [0], [2, 4, 5]]
  hot = np.zeros((4, 5), np.float32)  # 5 dataset classes, a 6-unit head: unit 5 is negative
  for i, s in enumerate(sets):
    hot[i, [c for c in s if c < 5]] = 1.0
  if kind == 'sigmoid_xent':
    y = np.pad(hot, ((0, 0), (0, 1)))
    want = -np.sum(y * _log_sigmoid(logits) + (1 - y) * _log_sigmoid(-logits), -1)
  else:
    log_p = logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))
    want = np.array([
        -np.mean(log_p[i, [c for c in s if c < 5]]) if any(c < 5 for c in s) else 0.0
        for i, s in enumerate(sets)
    ])
  got = step_lib.per_example_loss(logits.astype(np.float32), hot, kind)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Integer labels (every single-label run, the quickstart's included): bit for bit the
  # loss as written before multi-hot targets, jitted as the train step jits it.
  labels, logits = np.array([1, 0, 4, 2]), logits.astype(np.float32)
  onehot = lambda y: jax.nn.one_hot(y, logits.shape[-1])
  before = {
      'sigmoid_xent': lambda z, y: jnp.sum(optax.sigmoid_binary_cross_entropy(z, onehot(y)), axis=-1
                                          ),
      'softmax_xent': lambda z, y: -jnp.sum(onehot(y) * jax.nn.log_softmax(z), axis=-1)
  }
  now = jax.jit(lambda z, y: step_lib.per_example_loss(z, y, kind))(logits, labels)
  np.testing.assert_array_equal(now, jax.jit(before[kind])(logits, labels))
  hot = np.eye(6, dtype=np.float32)[labels]
  np.testing.assert_array_equal(now, step_lib.per_example_loss(logits, hot, kind))


@pytest.mark.parametrize('kind', ['softmax_xent', 'sigmoid_xent'])
def test_label_smoothing_moves_the_targets_toward_uniform(kind):
  logits = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
  labels = np.array([0, 3, 1])
  y = 0.9 * np.eye(4, dtype=np.float32)[labels] + 0.1 / 4
  if kind == 'sigmoid_xent':
    want = -np.sum(y * _log_sigmoid(logits) + (1 - y) * _log_sigmoid(-logits), -1)
  else:
    want = -np.sum(y * (logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))), -1)
  got = step_lib.per_example_loss(logits, labels, kind, label_smoothing=0.1)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert not np.allclose(got, step_lib.per_example_loss(logits, labels, kind))


@pytest.mark.parametrize(
    'capability,model_name,without',
    [
        (9.0, 'ViT-B_16', True),  # measured: 1.03-1.09x on an H200 (benchmarks/README.md)
        (9.0, 'R50+ViT-B_16', False),  # measured: 0.97-1.00x
        (9.0, 'BiT-M-R50x1', False),  # convolutions, as the hybrid's stem
        (0.0, 'ViT-B_16', False),  # not an NVIDIA GPU
    ])
def test_a_vit_step_compiles_without_command_buffers_on_an_nvidia_gpu(monkeypatch, capability,
                                                                      model_name, without):
  monkeypatch.setattr(accelerator, 'cuda_capability', lambda: capability)
  config = ml_collections.ConfigDict({'model_name': model_name, 'model': {}, 'remat': ''})
  options = step_lib.compiler_options(config) or {}
  assert (options == step_lib.NO_COMMAND_BUFFERS) == without, options
  assert not without or options  # and nothing else added on a GPU


def test_the_command_buffer_option_exists_in_this_jaxlib():
  # XLA refuses an option name it does not know, on every backend.
  jax.jit(lambda x: x + 1, compiler_options=step_lib.NO_COMMAND_BUFFERS).lower(1.0).compile()


def test_a_skipped_update_leaves_the_schedule_on_time():
  """on_nonfinite=skip: a skipped step keeps the moments, but the learning rate of every
  later update is the schedule's at its step, the one logged. The whole optimizer state had
  been kept, so each skip delayed the schedule by a step for the rest of the run."""
  # pylint: disable=g-import-not-at-top
  from vit_jax import models
  from vit_jax import optim
  from vit_jax import sharding
  from vit_jax.configs import quickstart
  # pylint: enable=g-import-not-at-top
  c = quickstart.get_config()
  c.model.num_layers = 1
  c.update(optimizer='sgd', momentum=0.0, base_lr=0.1, warmup_steps=4, total_steps=8,
           lr_decay='linear', weight_decay=0.0, grad_clip_norm=0.0, batch_size=8,
           on_nonfinite='skip')
  model = models.from_config(c, 10)
  schedule, tx = optim.learning_rate_schedule(c, 8), optim.make_optimizer(c, 8)
  mesh = sharding.make_mesh(c)
  state, shardings = step_lib.create_train_state(c, model, tx, mesh, 10)
  data, replicated = sharding.data_sharding(mesh), sharding.replicated(mesh)
  train_step = step_lib.jit(model, tx, schedule, c, mesh, (shardings, data, replicated))
  head_grad = jax.jit(
      jax.grad(lambda p, x, y: step_lib.per_example_loss(model.apply({'params': p}, x, train=False),
                                                         y, 'softmax_xent').mean()))
  rng = np.random.default_rng(0)
  applied, logged = [], []
  for i in range(6):
    images = rng.uniform(-1, 1, (8, 28, 28, 3)).astype(np.float32)
    labels = rng.integers(0, 10, 8).astype(np.int32)
    if i == 1:
      images[:] = np.nan  # skipped
    before = jax.device_get(state['params'])
    g = np.asarray(head_grad(before, images, labels)['head']['bias'])
    batch = {'image': jax.device_put(images, data), 'label': jax.device_put(labels, data)}
    state, metrics = train_step(state, batch, jax.device_put(jax.random.PRNGKey(0), replicated))
    moved = np.asarray(jax.device_get(state['params'])['head']['bias']) - before['head']['bias']
    if i != 1:  # SGD without momentum: the head bias moves by -lr * its gradient
      applied.append(float(-moved @ g / (g @ g)))
      logged.append(float(metrics['lr']))
  expected = [float(schedule(i)) for i in (0, 2, 3, 4, 5)]  # 0, 0.05, 0.075, 0.1, 0.075
  np.testing.assert_allclose(applied, expected, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(logged, expected, rtol=1e-6)
