"""How the absl programs run as console scripts (vit-train, vit-evaluate, ...) start:
`--help`, one-line flag errors, JAX's start-up notice that a TPU runtime is missing, and
Ctrl-C as one line (status 130), not a traceback. A single-valued flag given twice is
refused here in all eight commands, the argparse ones (vit-sweep, vit-vtab, vit-tpu,
vit-tfds-build) too.

absl's `--help` prints `__main__`'s docstring and the flags its module declared. Run as a
console script, `__main__` is pip's wrapper, with no docstring and no flags, so
`vit-train --help` printed only "USAGE: vit-train [flags]". `python -m` was not affected.
absl also exits 1 after printing the help; `run` makes it 0, as the argparse programs
(vit-sweep, vit-vtab, vit-tpu) and most command-line tools do.

absl shows INFO records on stderr, so on every CPU or GPU host the first line of
vit-evaluate, vit-predict and vit-inspect was JAX's "Unable to initialize backend 'tpu':
... Failed to open libtpu.so". Where no TPU runtime is installed that says nothing; where
one is (a TPU VM), the line explains a run that fell back to the CPU, and it stays. The
INFO chatter of orbax, JAX's internals and TFDS is dropped too: TFDS's "Constructing
tf.data.Dataset ..." lines stood above the one line that refuses a dataset not prepared.
"""
import argparse
import importlib.util
import logging
import os
import sys

from absl import app
from absl import flags
from absl import logging as absl_logging

from vit_jax import console_scripts
from vit_jax import ctrl_c
from vit_jax import errors
from vit_jax import jax_backend

HELP_FLAGS = frozenset({
    '--help', '-help', '--helpshort', '-helpshort', '--helpfull', '-helpfull', '--helpxml',
    '-helpxml', '-?'
})


def as_the_program(module_name, *flag_modules):
  """Makes `--help` print module `module_name`'s docstring and the flags that it and
  `flag_modules` (module names) define. Call after the flags are defined, before app.run."""
  main = sys.modules['__main__']
  if not main.__doc__:
    main.__doc__ = sys.modules[module_name].__doc__
  for name in (module_name, *flag_modules):
    for flag in flags.FLAGS.get_key_flags_for_module(name):
      flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)


def one_line_flag_errors(program):
  """A flags_parser for app.run: absl's parsing, with a mistyped flag or a bad flag value as
  one line naming `program` (absl prints 'FATAL Flags parsing error: ...' and a help hint)."""

  def parse(argv):
    try:
      rest = flags.FLAGS(argv)
    except flags.Error as e:
      sys.exit(f'{program}: {errors.plain_value_error(str(e).strip().splitlines()[0])} '
               '(see --help)')
    try:
      check_given_once(argv)
    except ValueError as e:
      sys.exit(f'{program}: {e} (see --help)')
    return rest

  return parse


def check_given_once(argv):
  """A ValueError for a single-valued flag given more than once in argv (absl takes the
  last: `--workdir=a --workdir=b` ran on b)."""
  name, values = _given_twice(argv)
  if name:
    listed = ', its values comma-separated' if 'list' in flags.FLAGS[name].flag_type() else ''
    raise ValueError(f'--{name} is given more than once ({", ".join(map(repr, values))}): give '
                     f'one{listed}')


class StoreOnce(argparse.Action):
  """argparse's 'store', refusing a second value (argparse, like absl, keeps the last:
  `vit-sweep --workdir=a ... --workdir=b` ran in b). Register it as each parser's default
  action: `parser.register('action', None, StoreOnce)`."""

  def __call__(self, parser, namespace, values, option_string=None):
    given = namespace.__dict__.setdefault('_given_once', {})
    if self.dest in given and option_string:
      listed = ', its values comma-separated' if 'comma-separated' in (self.help or '') else ''
      parser.error(f'{option_string} is given more than once ({given[self.dest]!r}, {values!r}): '
                   f'give one{listed}')
    given[self.dest] = values
    setattr(namespace, self.dest, values)


def _given_twice(argv):
  """(name, its values) of the first single-valued flag given more than once in argv, else
  (None, None)."""
  seen = {}
  args = argv[1:argv.index('--')] if '--' in argv else argv[1:]
  for i, arg in enumerate(args):
    if not arg.startswith('-') or arg in ('-', '--'):
      continue
    name, eq, value = arg.lstrip('-').partition('=')
    flag = flags.FLAGS[name] if name in flags.FLAGS else None
    if flag is None or isinstance(flag, flags.MultiFlag) or flag.boolean:
      continue
    if not eq:
      value = args[i + 1] if i + 1 < len(args) else ''
    seen.setdefault(name, []).append(value)
    if len(seen[name]) > 1:
      return name, seen[name]
  return None, None


def refuse_arguments(program, argv, hint):
  """Exits with one line where a command that takes only flags got more words (absl's
  UsageError had printed the whole --help, its last line no fix): `hint` names the flag a
  stray word most likely belongs to."""
  if len(argv) > 1:
    sys.exit(f'{program}: unexpected argument {" ".join(argv[1:])!r}: this command takes flags '
             f'only ({hint}; see --help)')


def _tpu_runtime_installed():
  return bool(importlib.util.find_spec('libtpu') or os.environ.get('TPU_LIBRARY_PATH'))


def _not_the_missing_tpu_notice(record):
  return not record.getMessage().startswith("Unable to initialize backend 'tpu'")


class _QuietLibraries:
  """Drops the INFO records of orbax, JAX's internals and TFDS (their warnings stay)."""
  _NOISY = ('/orbax/', '/jax/_src/', '/tensorflow_datasets/')

  def filter(self, record):
    return record.levelno > logging.INFO or not any(part in record.pathname for part in self._NOISY)


def quiet_the_libraries():
  """Drops the INFO records of orbax, JAX's internals and TFDS from absl's log (stderr, and
  vit-train's train.INFO), and JAX's notice of a missing TPU runtime where none is
  installed."""
  absl_logging.get_absl_handler().addFilter(_QuietLibraries())
  quiet_the_missing_tpu_notice()


def quiet_the_missing_tpu_notice():
  """Drops JAX's notice that it found no TPU runtime, unless one is installed."""
  if not _tpu_runtime_installed():
    logging.getLogger('jax._src.xla_bridge').addFilter(_not_the_missing_tpu_notice)


def run(main, module_name, *flag_modules, program=None, flags_parser=None):
  """as_the_program, then absl's app.run(main), with --help exiting 0; flag mistakes are
  one line naming `program` (default: the console script's name), and so is a JAX backend
  that cannot start (vit_jax/jax_backend.py); JAX's notice of a missing TPU runtime and the
  libraries' INFO chatter are dropped (quiet_the_libraries)."""
  as_the_program(module_name, *flag_modules)
  quiet_the_libraries()
  program = program or os.path.basename(sys.argv[0])
  console_scripts.prepare_the_process()  # again for `python -m`, which has no console script

  def main_or_its_backend_in_one_line(argv):
    try:
      return main(argv)
    except Exception as e:  # pylint: disable=broad-except
      if isinstance(e, (RuntimeError, AssertionError)):
        jax_backend.exit_if_it_cannot_start(program)  # else the error is not the backend's
      console_scripts.exit_if_unreachable(program)  # a bucket or folder it may not reach
      raise

  parse = flags_parser or one_line_flag_errors(program)
  try:
    app.run(main_or_its_backend_in_one_line, flags_parser=parse)
  except SystemExit as e:
    # absl exits 1 once it has printed the help, before main runs.
    if e.code == 1 and HELP_FLAGS & set(sys.argv[1:]):
      sys.exit(0)
    raise
  except KeyboardInterrupt:
    ctrl_c.interrupted(program)
