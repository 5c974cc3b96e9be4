"""TensorFlow's start-up notices are dropped from what the import wrote to stderr; every
other line is written back (the command-line journeys are in test_install.py)."""
import os
import subprocess
import sys
import tempfile

from vit_jax import tensorflow_quietly

# What TensorFlow 2.21 wrote on import on a 2-core AVX-512 host, and two lines of others.
CAPTURED = (
    'WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n'
    'I0000 00:00:1795767401.726993   12302 port.cc:153] oneDNN custom operations are on. You may '
    'see slightly different numerical results due to floating-point round-off errors from '
    'different computation orders. To turn them off, set the environment variable '
    '`TF_ENABLE_ONEDNN_OPTS=0`.\n'
    'I0000 00:00:1795767401.786829   12302 cpu_feature_guard.cc:227] This TensorFlow binary is '
    'optimized to use available CPU instructions in performance-critical operations.\n'
    'To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild '
    'TensorFlow with the appropriate compiler flags.\n'
    'E0000 00:00:1795767401.9 12302 some_library.cc:12] a real error\n'
    '/usr/lib/python3/warnings.py:1: DeprecationWarning: something\n')


def test_only_the_notices_are_dropped():
  assert tensorflow_quietly.kept_lines(CAPTURED) == [
      'E0000 00:00:1795767401.9 12302 some_library.cc:12] a real error\n',
      '/usr/lib/python3/warnings.py:1: DeprecationWarning: something\n'
  ]


def test_no_descriptor_is_left_open_when_the_pipe_cannot_be_made():
  """os.pipe() failing (no descriptor left) after stderr was duplicated: the duplicate is
  closed, and TensorFlow is imported all the same."""
  script = '''
import os, sys
dups, closed = [], []
real_dup, real_close = os.dup, os.close
os.dup = lambda fd: dups.append(real_dup(fd)) or dups[-1]
os.close = lambda fd: closed.append(fd) or real_close(fd)
def no_pipe():
  raise OSError(24, 'Too many open files')
os.pipe = no_pipe
import vit_jax.tensorflow_quietly
assert 'tensorflow' in sys.modules
assert dups and dups[0] in closed, (dups, closed)
print('ok')
'''
  assert _child(script) == 'ok\n'


def _child(script, *args, **env_vars):
  """Runs `script` (with `args` in sys.argv) in a fresh Python that imports the vit_jax under
  test (wherever pytest was started from); its stdout, once it exited 0."""
  package_root = os.path.dirname(os.path.dirname(tensorflow_quietly.__file__))
  env = dict(
      os.environ,
      PYTHONPATH=os.pathsep.join([package_root, *filter(None, [os.environ.get('PYTHONPATH')])]))
  env.pop('TF_USE_LEGACY_KERAS', None)
  env.update(env_vars)
  p = subprocess.run([sys.executable, '-c', script, *args], capture_output=True, text=True,
                     timeout=300, env=env, cwd=tempfile.gettempdir())
  assert p.returncode == 0, p.stderr[-2000:]
  return p.stdout


KERAS_SCRIPT = '''
import os, sys
import vit_jax.tensorflow_quietly
print('keras' in sys.modules, 'matplotlib' in sys.modules, os.environ.get('TF_USE_LEGACY_KERAS'))
import tensorflow as tf
print(type(tf.keras.layers.Dense(2)).__module__.split('.')[0])
'''


def test_keras_is_left_out_of_the_import_and_loads_on_first_use():
  """Keras (and matplotlib through it) is not imported with TensorFlow, the variable that
  keeps it out is gone after the import, and tf.keras still gives Keras 3 when asked."""
  assert _child(KERAS_SCRIPT).split() == ['False', 'False', 'None', 'keras']


def test_a_users_tf_use_legacy_keras_is_left_as_set():
  assert _child(KERAS_SCRIPT, TF_USE_LEGACY_KERAS='0').split() == ['True', 'True', '0', 'keras']


TRAINING_SCRIPT = '''
import sys
import vit_jax.tensorflow_quietly
import vit_jax.train
from vit_jax import tensorboard_events
writer = tensorboard_events.EventWriter(sys.argv[1])
writer.write_hparams({'base_lr': 0.1})
writer.write_scalars(1, {'loss': 1.0})
writer.close()
print('keras' in sys.modules, 'matplotlib' in sys.modules)
'''


def test_the_training_loop_and_its_event_files_load_no_keras(tmp_path):
  """vit-train's imports, and its TensorBoard writes, leave Keras out (clu's writer, used
  before, loaded it through tensorboard's hparams API)."""
  assert _child(TRAINING_SCRIPT, str(tmp_path)).split() == ['False', 'False']


DECODE_A_CUT_JPEG = '''
import io, os, sys
import jax  # sets TF_CPP_MIN_LOG_LEVEL=1 where it is unset, as in every command
import numpy as np
from PIL import Image
from vit_jax import tensorflow_quietly
import tensorflow as tf
jpeg = io.BytesIO()
Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), np.uint8)).save(jpeg, 'JPEG')
try:
  tf.io.decode_jpeg(jpeg.getvalue()[:len(jpeg.getvalue()) // 2])  # "Premature end of JPEG data"
except tf.errors.InvalidArgumentError:
  print(os.environ.get('TF_CPP_MIN_LOG_LEVEL'))
'''


def test_tensorflow_s_cpp_log_is_kept_to_fatal_errors_unless_asked_for():
  """A damaged image's decode, which the commands report in one line, had been logged first
  by TensorFlow in two lines (per image, on every pass over a folder dataset)."""
  env = {k: v for k, v in os.environ.items() if k != 'TF_CPP_MIN_LOG_LEVEL'}
  quiet = subprocess.run([sys.executable, '-c', DECODE_A_CUT_JPEG], env=env, capture_output=True,
                         text=True, timeout=120)
  assert quiet.stdout == '1\n', quiet.stderr[-2000:]  # put back for XLA, which reads it too
  assert quiet.stderr == '', quiet.stderr[-2000:]
  asked = subprocess.run([sys.executable, '-c', DECODE_A_CUT_JPEG],
                         env=dict(env, TF_CPP_MIN_LOG_LEVEL='0'), capture_output=True, text=True,
                         timeout=120)
  assert asked.stdout == '0\n' and 'Premature end of JPEG data' in asked.stderr, asked.stderr[
      -2000:]
