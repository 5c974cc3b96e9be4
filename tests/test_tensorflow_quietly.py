"""TensorFlow's start-up notices are dropped from what the import wrote to stderr; every
other line is written back (the command-line journeys are in test_install.py)."""
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
