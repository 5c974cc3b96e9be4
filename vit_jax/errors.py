"""The errors a run ends with (vit-train prints each as one line, `vit-train: <message>`), and
the plain words every command uses for a value of the wrong type."""
import errno
import os
import re
import shutil

# What vit-train's one-line errors start with (`python -m vit_jax.main` is the same program).
PROGRAM = 'vit-train'


class ConfigError(ValueError):
  """A bad config or data source found at start-up; main prints it as one line."""


class TrainingError(ConfigError):
  """A fault met while training (divergence, a failed save): one line, exit 1.

  A subclass of ConfigError so that main prints it the same way.
  """
  status = 1


class StoppedBySignal(TrainingError):
  """The run stopped at a step on SIGTERM, Ctrl-C or SIGHUP, after saving it: the exit
  status is the shell's for that signal (128 + its number: 143, 130, 129), so that a
  scheduler, a resume loop or `&&` reads a run that did not finish as one."""

  def __init__(self, message, signum):
    super().__init__(message)
    self.status = 128 + signum


def count_of(n, noun):
  """'1 image', '2 images': a count with its noun (plurals by an s)."""
  return f'{n} {noun}{"" if n == 1 else "s"}'


def one_line(error):
  """One line of an exception's text (the last non-empty one), at most 300 characters."""
  if isinstance(error, OSError) and error.strerror:
    return f'{error.strerror} ({error.filename})' if error.filename else error.strerror
  lines = [l.strip() for l in str(error).splitlines() if l.strip()]
  text = lines[-1] if lines else type(error).__name__
  return text if len(text) <= 300 else text[:297] + '...'


# The fix for a write that failed with each errno; any other: _WRITE_FIX.
_WRITE_FIXES = {
    errno.ENOSPC: 'free space there',
    errno.EDQUOT: 'free space there or raise your disk quota',
    errno.EACCES: 'give this user write permission there',
    errno.EPERM: 'give this user write permission there',
    errno.EROFS: 'its file system is mounted read-only: remount it writable',
    errno.EFBIG: ("a file outgrew the shell's file-size limit (ulimit -f) or the file system's: "
                  'raise it (ulimit -f unlimited)'),
}
_WRITE_FIX = 'free space or fix permissions there'
_NEARLY_FULL = 64 << 20  # free bytes below which a write failing without an errno is blamed on space


def write_failure(error, where):
  """'<cause>: <fix>' of a write under `where` (a file or folder) that raised `error`.

  The cause is the errno's text where one is found: an OSError down the exception chain,
  or tensorstore's os_error_code, whose surrounding text varies (seen: the file's JSON spec).
  A failure that carries none (TensorFlow's 'Could not flush events file') on a nearly full
  disk is said to be one. The fix is the errno's: a full disk and a file-size limit had both
  been told to 'free space or fix permissions'.
  """
  code, cause = _errno_and_cause(error)
  if code is None:
    free = _free_bytes(where)
    if free is not None and free < _NEARLY_FULL:
      code, cause = errno.ENOSPC, f'{cause} ({free >> 10} KiB free on its disk)'
  return f'{cause}: {_WRITE_FIXES.get(code, _WRITE_FIX)}'


def _errno_and_cause(error):
  """(errno or None, one line naming the root cause) of a failed write."""
  seen = error
  while seen is not None:
    if isinstance(seen, OSError) and seen.strerror:
      return seen.errno, one_line(seen)
    seen = seen.__cause__ or seen.__context__
  found = re.search(r'os_error_code=\'?(\d+)', str(error))
  if found:
    code = int(found.group(1))
    return code, f'{os.strerror(code)} (errno {code})'
  return None, one_line(error)


def _free_bytes(where):
  """Free bytes on the local disk holding `where` (or its nearest existing folder above), or
  None (an object store, or nothing there to ask)."""
  if '://' in str(where):
    return None
  path = os.path.abspath(where)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  try:
    return shutil.disk_usage(path).free
  except OSError:
    return None


def op_error_line(error):
  """The first line of a TensorFlow op error without its graph-node markup ({{...}}, [[...]])."""
  text = getattr(error, 'message', None) or str(error)
  text = re.sub(r'\{\{[^}]*\}\}|\[\[.*?\]\]', '', text)
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  return lines[0] if lines else type(error).__name__


# What to check where a gs:// path cannot be read or written.
GCS_FIX = ("check the bucket name, this machine's network and its credentials (gcloud auth "
           'application-default login)')


def storage_why(error):
  """Why a file could not be reached, in at most 140 characters (a fix can follow within
  one_line's 300): one_line of an OSError; of TensorFlow's errors, op_error_line less the GCS
  client's preamble, 'All 10 retry attempts failed. The last failure: Error executing an HTTP
  request: ' (gfile's last line is only '\t when reading metadata of <path>')."""
  if isinstance(error, OSError):
    return one_line(error)
  why = re.sub(
      r'^(All \d+ retry attempts failed\. The last failure: )?'
      r'(Error executing an HTTP request: )?', '', op_error_line(error))
  return why if len(why) <= 140 else why[:137] + '...'


# TensorFlow's errors of reaching a file, not of its contents (InvalidArgument, DataLoss, ...).
_ACCESS_ERRORS = {
    'FailedPreconditionError', 'PermissionDeniedError', 'UnauthenticatedError', 'UnavailableError',
    'DeadlineExceededError', 'AbortedError', 'NotFoundError'
}


def unreachable_path(error):
  """One line for an error of reaching a file, or None for any other error: TensorFlow's on a
  gs:// path ('cannot access gs://B/P: <why>: <GCS_FIX>'; TFDS raises it inside a
  RuntimeError), or a local file or folder this user may not read or write (TensorFlow's
  PermissionDenied, Python's PermissionError)."""
  cause = error.__cause__ if isinstance(error, RuntimeError) and error.__cause__ else error
  if isinstance(cause, PermissionError) and cause.filename:
    return f'cannot access {cause.filename}: permission denied: {_PERMISSION_FIX}'
  if not (type(cause).__module__.startswith('tensorflow')
          and type(cause).__name__ in _ACCESS_ERRORS):
    return None
  text = getattr(cause, 'message', None) or str(cause)
  bucket = re.search(r'gs://[^\s\'"]+', text)
  if bucket:
    return f'cannot access {bucket[0]}: {storage_why(cause)}: {GCS_FIX}'
  local = re.fullmatch(r'(.+); Permission denied', op_error_line(cause))  # gfile's words
  if type(cause).__name__ == 'PermissionDeniedError' and local:
    return f'cannot access {local[1]}: permission denied: {_PERMISSION_FIX}'
  return None


_PERMISSION_FIX = 'give this user permission there, or run the command as the user who owns it'

# Python's words for a flag value of the wrong type -> what the flag expects.
_CONVERSION_ERRORS = (
    (r'invalid literal for int\(\) with base \d+: .*', 'expected an integer'),
    (r'could not convert string to float: .*', 'expected a number'),
    (r"\('Non-boolean argument to boolean flag', .*\)", 'expected true or false'),
)


def plain_value_error(line):
  """'flag --config.batch_size=abc: invalid literal for int()...' -> '...: expected an
  integer' (the same words from every command)."""
  for pattern, plain in _CONVERSION_ERRORS:
    line = re.sub(f'(?<=: ){pattern}$', plain, line)
  # absl's words for each required flag left out, one sentence per flag on one line.
  missing = re.fullmatch(
      r'(?:flag --(\w+)=None: Flag --\1 must have a value other than None\.'
      r' ?)+', line)
  if not missing:
    return line
  names = re.findall(r'flag --(\w+)=None', line)
  return (f'{" and ".join(f"--{n}" for n in names)} '
          f'{"is" if len(names) == 1 else "are"} required: pass '
          f'{" ".join(f"--{n}=..." for n in names)}')
