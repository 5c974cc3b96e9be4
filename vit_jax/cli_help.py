"""`--help` for the absl programs run as console scripts (vit-train, vit-evaluate, ...).

absl's `--help` prints `__main__`'s docstring and the flags its module declared. Run as a
console script, `__main__` is pip's wrapper, with no docstring and no flags, so
`vit-train --help` printed only "USAGE: vit-train [flags]". `python -m` was not affected.
absl also exits 1 after printing the help; `run` makes it 0, as the argparse programs
(vit-sweep, vit-vtab, vit-tpu) and most command-line tools do.
"""
import os
import sys

from absl import app
from absl import flags

from vit_jax import errors

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
      return flags.FLAGS(argv)
    except flags.Error as e:
      sys.exit(f'{program}: {errors.plain_value_error(str(e).strip().splitlines()[0])} '
               '(see --help)')

  return parse


def run(main, module_name, *flag_modules, program=None, flags_parser=None):
  """as_the_program, then absl's app.run(main), with --help exiting 0; flag mistakes are
  one line naming `program` (default: the console script's name)."""
  as_the_program(module_name, *flag_modules)
  program = program or os.path.basename(sys.argv[0])
  try:
    app.run(main, flags_parser=flags_parser or one_line_flag_errors(program))
  except SystemExit as e:
    # absl exits 1 once it has printed the help, before main runs.
    if e.code == 1 and HELP_FLAGS & set(sys.argv[1:]):
      sys.exit(0)
    raise
