"""Local and remote (gs://, other URL schemes) paths: one place that tells them apart.

Local paths may be relative or start with '~'; they are made absolute once, at start-up
(orbax refuses relative checkpoint paths). Remote paths go through TensorFlow's gfile,
imported only when one is used.
"""
import os


def is_remote(path):
  return '://' in str(path)


def resolve(path):
  """An absolute local path ('~' expanded), or a remote path unchanged."""
  path = str(path)
  if is_remote(path):
    return path
  return os.path.abspath(os.path.expanduser(path))


def open_file(path, mode):
  """open() for local files, tf.io.gfile.GFile for remote ones."""
  if is_remote(path):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top  (only for remote paths)
    return tf.io.gfile.GFile(str(path), mode)
  return open(path, mode)


def exists(path):
  if is_remote(path):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.io.gfile.exists(str(path))
  return os.path.exists(path)


def makedirs(path):
  if is_remote(path):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.io.gfile.makedirs(str(path))
  else:
    os.makedirs(path, exist_ok=True)
