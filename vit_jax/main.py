r"""Entry point: python -m vit_jax.main --config=configs/<file>.py[:<args>] --workdir=DIR.

Any config field can be overridden: --config.base_lr=0.01 --config.model.dropout_rate=0.1.
On several hosts the same command runs once per host: Cloud TPU VMs are detected by
jax.distributed.initialize(); elsewhere pass --coordinator_address, --num_processes and
--process_id (or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).
"""
import os
import sys

# Config files import `configs.common`: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
import jax  # noqa: E402
from ml_collections import config_flags  # noqa: E402

config_flags.DEFINE_config_file('config', None, 'A config file, with its argument after ":".',
                                lock_config=True)
flags.DEFINE_string('workdir', None, 'Checkpoints, TensorBoard logs and the log go here.')
flags.DEFINE_string('coordinator_address', os.environ.get('JAX_COORDINATOR_ADDRESS'),
                    'host:port of process 0, for runs on several hosts outside Cloud TPU.')
flags.DEFINE_integer('num_processes', int(os.environ.get('JAX_NUM_PROCESSES', 0)) or None,
                     'Number of processes (hosts).')
flags.DEFINE_integer('process_id', int(os.environ.get('JAX_PROCESS_ID', -1)),
                     'This process\'s index, 0 .. num_processes-1.')
flags.mark_flags_as_required(['config', 'workdir'])
FLAGS = flags.FLAGS


def _on_cloud_tpu_pod():
  return bool(os.environ.get('TPU_WORKER_HOSTNAMES', '').count(','))


def initialize_distributed():
  """jax.distributed.initialize() when running on several hosts; a no-op otherwise."""
  if FLAGS.coordinator_address:
    if not FLAGS.num_processes or FLAGS.process_id < 0:
      raise app.UsageError('--coordinator_address needs --num_processes and --process_id')
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  elif _on_cloud_tpu_pod():
    jax.distributed.initialize()  # addresses and ids come from the TPU metadata


class _QuietLibraries:
  """Drops the INFO chatter of orbax and jax internals from the log (warnings stay)."""
  _NOISY = ('/orbax/', '/jax/_src/', '/clu/metric_writers/')

  def filter(self, record):
    return record.levelno > logging.converter.STANDARD_INFO or not any(
        part in record.pathname for part in self._NOISY)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  initialize_distributed()
  from vit_jax import train  # pylint: disable=g-import-not-at-top  (after distributed init)
  os.makedirs(FLAGS.workdir, exist_ok=True)
  logging.get_absl_handler().use_absl_log_file('train', FLAGS.workdir)  # readable log
  logging.get_absl_handler().addFilter(_QuietLibraries())
  FLAGS.alsologtostderr = True
  logging.info('process %d/%d, %d local / %d global devices (%s)', jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count(),
               jax.devices()[0].platform)
  try:
    train.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  except train.ConfigError as e:
    sys.exit(f'vit_jax: {e}')


if __name__ == '__main__':
  app.run(main)
