"""vit_jax/pipeline_priority.py: on the CPU backend the threads tf.data starts for a stream
run at SCHED_IDLE, and only those; errors of the first read reach the caller."""
import os

import numpy as np
import pytest
import tensorflow as tf

from tests import data_fixtures as fx
from vit_jax import input_pipeline as ip
from vit_jax import pipeline_priority
from vit_jax.configs import common


def _threads():
  return {int(t) for t in os.listdir('/proc/self/task')}


def _policy(tid):
  try:
    return os.sched_getscheduler(tid)
  except OSError:  # the thread has ended
    return None


def _cpu_ticks(tid):
  """User + system CPU time of thread `tid`, in clock ticks (0 once it has ended)."""
  try:
    with open(f'/proc/self/task/{tid}/stat') as f:
      fields = f.read().rsplit(')', 1)[1].split()
  except OSError:
    return 0
  return int(fields[11]) + int(fields[12])


@pytest.fixture(scope='module')
def jpegs(tmp_path_factory):
  root = str(tmp_path_factory.mktemp('jpegs'))
  fx.write_jpegs(root, 32)  # 375x500, as ImageNet's
  return root


@pytest.mark.parametrize('enabled', [True, False])
def test_the_threads_tf_data_starts_run_at_idle_priority(jpegs, monkeypatch, enabled):
  monkeypatch.setattr(pipeline_priority, 'ENABLED', enabled)
  assert pipeline_priority.applies() == enabled  # the suite runs on the CPU backend
  c = common.get_config()
  c.update(dataset=f'folder:{jpegs}', train_split='train', image_size=224, shuffle_buffer=32)
  batches = ip.train_batches(c, global_batch=16)  # (starts JAX and TensorFlow if not yet)
  before = _threads()
  first = next(batches)
  for _ in range(5):
    batch = next(batches)
  assert batch['image'].shape == first['image'].shape == (16, 224, 224, 3)
  started = {t: (_policy(t), _cpu_ticks(t)) for t in _threads() - before}
  busy = {t for t, (_, ticks) in started.items() if ticks}
  assert busy, started  # the decoding ran on threads started for this stream
  policies = {policy for policy, _ in started.values()} - {None}
  assert policies == ({os.SCHED_IDLE} if enabled else {os.SCHED_OTHER}), started
  assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the loop's thread keeps its priority


def test_what_the_first_read_raises_reaches_the_caller():
  with pytest.raises(StopIteration):
    pipeline_priority.numpy_iterator(tf.data.Dataset.range(0))
  bad = tf.data.Dataset.from_tensors(b'not an image').map(tf.io.decode_png)
  with pytest.raises(tf.errors.InvalidArgumentError):
    pipeline_priority.numpy_iterator(bad)
  iterator, first = pipeline_priority.numpy_iterator(tf.data.Dataset.range(3))
  assert [first, *iterator] == [0, 1, 2] and isinstance(first, np.int64)
