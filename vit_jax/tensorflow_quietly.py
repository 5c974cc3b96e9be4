"""TensorFlow, imported without the notices its C++ libraries print as they load.

TensorFlow 2.21 writes four lines to stderr on import (absl's "All log messages before
absl::InitializeLog() ..." and "oneDNN custom operations are on ...", twice), ahead of
TF_CPP_MIN_LOG_LEVEL, which no longer drops them. A command-line program's first output,
often a one-line error for a mistyped value, then came fifth. Importing this module
imports TensorFlow with file descriptor 2 captured and writes back every captured line
except those notices (and the CPU-instruction notice, which TF_CPP_MIN_LOG_LEVEL drops
when set). The command-line programs import it before anything that imports TensorFlow;
`import vit_jax` does not, so a notebook gets TensorFlow as it comes.
Turning the oneDNN operations off (TF_ENABLE_ONEDNN_OPTS=0) would also silence them, but
the input pipeline ran slower without them (benchmarks/README.md, twenty-seventh session).
"""
import os
import re
import sys
import tempfile

NOTICES = re.compile(r'WARNING: All log messages before absl::InitializeLog\(\) is called'
                     r'|\] oneDNN custom operations are on'
                     r'|cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized'
                     r'|^To enable the following instructions: .*rebuild TensorFlow')


def kept_lines(captured):
  """The lines of `captured` (text written to stderr during the import) that are not
  TensorFlow's start-up notices."""
  return [line for line in captured.splitlines(keepends=True) if not NOTICES.search(line)]


def _import_tensorflow():
  if 'tensorflow' in sys.modules:
    return
  sys.stderr.flush()
  try:
    saved = os.dup(2)
  except OSError:  # no stderr to capture
    import tensorflow  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    return
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      import tensorflow  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      sys.stderr.writelines(kept_lines(captured.read().decode(errors='replace')))
      sys.stderr.flush()


_import_tensorflow()
