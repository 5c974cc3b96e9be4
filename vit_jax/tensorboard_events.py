"""The TensorBoard event file of a training run: its scalars and its hyperparameters.

What clu's default writer wrote (tf.summary scalars, tensorboard's hparams summary), without
what it imported: clu writes hyperparameters through tensorboard's `hparams.api`, whose Keras
callback subclasses `tf.keras.callbacks.Callback` at import, so every vit-train loaded Keras 3
and matplotlib (~1 s of CPU) for nothing. `hparams.summary_v2` writes the same summary and
imports no Keras. The log lines are train.py's own; clu's logging writer repeated them.
"""
from tensorboard.plugins.hparams import summary_v2 as hparams_summary
import tensorflow as tf


def hparams_of(config):
  """{name: value} of a config for TensorBoard's HPARAMS tab: nested fields by their dotted
  name (model.dropout_rate, pp.flip), tuples and lists as their text; None left out."""
  flat = {}

  def add(prefix, value):
    if isinstance(value, dict):
      for k, v in value.items():
        add(f'{prefix}{k}.', v)
    elif isinstance(value, (bool, int, float, str)):
      flat[prefix[:-1]] = value
    elif isinstance(value, (tuple, list)):
      flat[prefix[:-1]] = str(tuple(value))

  add('', config.to_dict())
  return flat


class EventWriter:
  """Writes a run's scalars and hyperparameters to an event file in `logdir`.

  Only the process that writes (`active`; process 0 of a multi-host run) opens a file; the
  others' writes do nothing. Writes are synchronous (TensorFlow's writer buffers them and
  flushes in the background), so a failed write raises where it was made: OSError or
  tf.errors.OpError, as `tf.summary.create_file_writer` does for a directory it cannot
  write.
  """

  def __init__(self, logdir, *, active=True):
    self._file = tf.summary.create_file_writer(logdir) if active else None

  def write_scalars(self, step, scalars):
    """`scalars`: {name: number} at `step`."""
    if self._file is None:
      return
    with self._file.as_default():
      for name, value in scalars.items():
        tf.summary.scalar(name, value, step=step)

  def write_hparams(self, hparams):
    """`hparams`: {name: bool, int, float or str}, for TensorBoard's HPARAMS tab."""
    if self._file is None:
      return
    with self._file.as_default():
      hparams_summary.hparams(hparams)

  def flush(self):
    if self._file is not None:
      self._file.flush()

  def close(self):
    if self._file is not None:
      self._file.close()
