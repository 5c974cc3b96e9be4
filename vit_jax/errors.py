"""The errors a run ends with (vit-train prints each as one line, `vit-train: <message>`), and
the plain words every command uses for a value of the wrong type."""
import re

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


def one_line(error):
  """One line of an exception's text (the last non-empty one), at most 300 characters."""
  if isinstance(error, OSError) and error.strerror:
    return f'{error.strerror} ({error.filename})' if error.filename else error.strerror
  lines = [l.strip() for l in str(error).splitlines() if l.strip()]
  text = lines[-1] if lines else type(error).__name__
  return text if len(text) <= 300 else text[:297] + '...'


def op_error_line(error):
  """The first line of a TensorFlow op error without its graph-node markup ({{...}}, [[...]])."""
  text = getattr(error, 'message', None) or str(error)
  text = re.sub(r'\{\{[^}]*\}\}|\[\[.*?\]\]', '', text)
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  return lines[0] if lines else type(error).__name__


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
