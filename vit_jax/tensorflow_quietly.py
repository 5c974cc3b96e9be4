"""TensorFlow, imported without the notices its C++ libraries print as they load, and
without Keras.

TensorFlow 2.21 writes four lines to stderr on import (absl's "All log messages before
absl::InitializeLog() ..." and "oneDNN custom operations are on ...", twice), ahead of
TF_CPP_MIN_LOG_LEVEL, which no longer drops them. A command-line program's first output,
often a one-line error for a mistyped value, then came fifth. Importing this module
imports TensorFlow with file descriptor 2 captured and writes back every captured line
except those notices (and the CPU-instruction notice, which TF_CPP_MIN_LOG_LEVEL drops
when set). The command-line programs import it before anything that imports TensorFlow;
`import vit_jax` does not; the quickstart notebook imports it first, as ipykernel shows
what is written to fd 2 in the cell's output.
Turning the oneDNN operations off (TF_ENABLE_ONEDNN_OPTS=0) would also silence them, but
the input pipeline ran slower without them (benchmarks/README.md, twenty-seventh session).

TensorFlow's C++ log is kept to fatal errors, unless TF_CPP_MIN_LOG_LEVEL is 0 or 2 (1 is
what `import jax` sets where it is unset): TensorFlow decodes the images and reads the files
here, and each of its failures is an exception that the commands report in one line (a
skipped image by its file, once). Its log had said each first: "Premature end of JPEG data"
and "Local rendezvous is aborting ..." per damaged image, again on every pass over a folder
dataset. TensorFlow reads the level as it loads; the variable is put back after, so that
XLA's log, which reads it too, keeps its level. (A JPEG cut inside its header still prints
libjpeg's own "Improper call to JPEG library in state 201", which no level drops.)

TensorFlow's import also imports Keras 3 (keras.src.optimizers, and through Keras
matplotlib.pyplot), ~1 s of CPU, for a library no command uses. With TF_USE_LEGACY_KERAS set
it imports tf_keras instead, or nothing when tf_keras is not installed. So, unless the user
set it or has tf_keras, the import runs with it set and it is removed after: `tf.keras` still
loads Keras 3 on first use, as TensorFlow's lazy loader reads the variable then. Nothing
vit-train imports later loads it either: its event files are written without tensorboard's
hparams API, which would (`vit_jax/tensorboard_events.py`). Where no home folder is known,
the Keras config TensorFlow writes as it loads goes to the temporary folder (see below).
"""
import contextlib
import importlib.util
import os
import re
import sys
import tempfile
import threading

from vit_jax import paths

NOTICES = re.compile(r'WARNING: All log messages before absl::InitializeLog\(\) is called'
                     r'|\] oneDNN custom operations are on'
                     r'|cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized'
                     r'|^To enable the following instructions: .*rebuild TensorFlow')


def kept_lines(captured):
  """The lines of `captured` (text written to stderr during the import) that are not
  TensorFlow's start-up notices."""
  return [line for line in captured.splitlines(keepends=True) if not NOTICES.search(line)]


@contextlib.contextmanager
def _keras_left_out():
  if 'TF_USE_LEGACY_KERAS' in os.environ or importlib.util.find_spec('tf_keras') is not None:
    yield
    return
  os.environ['TF_USE_LEGACY_KERAS'] = '1'
  try:
    yield
  finally:
    del os.environ['TF_USE_LEGACY_KERAS']


@contextlib.contextmanager
def _cpp_log_kept_to_fatal_errors():
  level = os.environ.get('TF_CPP_MIN_LOG_LEVEL')
  if level not in (None, '1'):
    yield
    return
  os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'
  try:
    yield
  finally:
    if level is None:
      del os.environ['TF_CPP_MIN_LOG_LEVEL']
    else:
      os.environ['TF_CPP_MIN_LOG_LEVEL'] = level


@contextlib.contextmanager
def _keras_config_kept_out_of_the_current_folder():
  """TensorFlow's bundled Keras writes ~/.keras/keras.json as it loads: where '~' names no
  home (HOME unset, as in some containers, and no passwd entry), that was ./~/.keras in the
  folder the command ran in. There it goes to the temporary folder's .keras instead."""
  if 'KERAS_HOME' in os.environ or paths.home():
    yield
    return
  os.environ['KERAS_HOME'] = os.path.join(tempfile.gettempdir(), '.keras')
  try:
    yield
  finally:
    del os.environ['KERAS_HOME']


def _import_tensorflow():
  if 'tensorflow' in sys.modules:
    return
  with (_keras_left_out(), _cpp_log_kept_to_fatal_errors(),
        _keras_config_kept_out_of_the_current_folder()):
    _import_tensorflow_quietly()


def _import_tensorflow_quietly():
  sys.stderr.flush()
  saved = None
  try:
    saved = os.dup(2)
    read_end, write_end = os.pipe()
  except OSError:  # no stderr to capture, or no descriptor left
    if saved is not None:
      os.close(saved)
    import tensorflow  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    return
  # A pipe, not a file: a process limited in file size (RLIMIT_FSIZE) would lose lines. A
  # thread drains it, so that an import writing more than the pipe holds does not block.
  chunks = []
  reader = threading.Thread(target=_drain, args=(read_end, chunks), daemon=True)
  reader.start()
  os.dup2(write_end, 2)
  os.close(write_end)
  try:
    import tensorflow  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)  # the pipe's last write end closes: the reader sees its end
    os.close(saved)
    # Unless something started during the import holds a copy of it: then go on with what
    # was read (all the import wrote is in the pipe by now).
    reader.join(timeout=2.0)
    sys.stderr.writelines(kept_lines(b''.join(list(chunks)).decode(errors='replace')))
    sys.stderr.flush()


def _drain(fd, chunks):
  with os.fdopen(fd, 'rb', buffering=0) as pipe:
    while chunk := pipe.read(65536):
      chunks.append(chunk)


_import_tensorflow()
