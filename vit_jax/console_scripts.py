"""The console scripts' entry points (setup.py's CONSOLE_SCRIPTS): each imports its
command's module with Ctrl-C held until the import is done, then one line. Those imports
take up to a second (TensorFlow, JAX); Ctrl-C there printed a KeyboardInterrupt traceback
of ~40 lines, crashed jaxlib's initialisation (SIGSEGV, or an ImportError), or was dropped
and the command ran on. This module imports nothing heavy itself.
"""
import importlib
import os
import signal
import sys

from vit_jax import ctrl_c
from vit_jax import errors


def _command(module, function, takes_signals_over=False):
  """The entry point that runs `module`.`function`() once `module` is imported. Where
  `takes_signals_over` (vit-train), SIGTERM and SIGHUP are held too, and through the call:
  it unblocks them once its own start-up handlers are in place (vit_jax/main.py), so that
  each is its one line there too, not a silent death."""
  also = (signal.SIGTERM, signal.SIGHUP) if takes_signals_over else ()

  def start():
    prepare_the_process()

    def imported_and_run():
      with ctrl_c.held(*also):
        entry = getattr(importlib.import_module(module), function)
        if takes_signals_over:
          return _flushed(entry)
      return _flushed(entry)

    return _guarded(imported_and_run, os.path.basename(sys.argv[0]))

  start.__doc__ = f'{module}.{function}(), imported with Ctrl-C as one line.'
  return start


def run_as_main(entry, program):
  """`python -m` of a module whose console script `program` runs entry(): the same process
  set-up and the same one lines (Ctrl-C, a reader gone, a file it cannot reach)."""
  prepare_the_process()
  sys.exit(_guarded(lambda: _flushed(entry), program))


def _guarded(run, program):
  """run(), with a Ctrl-C before the command's own handling, a reader gone and a file it
  cannot reach (exit_if_unreachable) each ending the command `program` as its one line."""
  try:
    return run()
  except KeyboardInterrupt:  # importing, or before the command's own handling
    ctrl_c.interrupted(program)
  except BrokenPipeError:
    _reader_gone()
  except Exception:  # pylint: disable=broad-except  (TensorFlow's OpError, PermissionError)
    exit_if_unreachable(program)
    raise


def exit_if_unreachable(program):
  """Exits with one line where the exception being handled is one of reaching a file
  (errors.unreachable_path): a bucket misnamed, not this machine's, or no network, or a local
  folder this user may not read, had ended each command in a traceback wherever it was first
  read (a workdir's config.json or checkpoints, a sweep's sweep.json, a folder: dataset).
  Other errors are left to their traceback."""
  line = errors.unreachable_path(sys.exc_info()[1])
  if line:
    sys.exit(f'{program}: {line}')


def prepare_the_process():
  """What each command does first, as a console script and with `python -m` (there from its
  module's start: cli_help.run, vit_jax.main.run, the launch modules' __main__): closed
  standard streams reopened, characters stdout cannot encode escaped, and a Ctrl-C raised
  where Python would only print it sent again. Each step is done once however often called."""
  reopen_closed_streams()
  ctrl_c.deliver_lost_ones()
  _unencodable_escaped()


def reopen_closed_streams():
  """Opens /dev/null on standard file descriptors that were closed (`vit-train >&-`, some
  daemonizers). Python had set sys.stdout to None, whose first flush ended the command in a
  traceback; and the next file the command opened took the free descriptor, so that
  TensorFlow's and XLA's C++ log lines to fd 2 would have gone into it (the log, a checkpoint)."""
  for fd, name in ((0, 'stdin'), (1, 'stdout'), (2, 'stderr')):
    try:
      os.fstat(fd)
      continue
    except OSError:
      pass
    null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)  # the lowest free: fd
    if null != fd:
      os.dup2(null, fd)
      os.close(null)
    if getattr(sys, name) is None:  # as Python makes them: stderr line-buffered
      stream = open(fd, 'r' if fd == 0 else 'w', buffering=1 if fd == 2 else -1,
                    errors='backslashreplace', closefd=False)
      setattr(sys, name, stream)


def _flushed(entry):
  """entry(), then stdout flushed here, where a reader that stopped raises BrokenPipeError
  for start to end quietly. Left to Python's flush at exit (stdout to a pipe is buffered
  unless PYTHONUNBUFFERED is set), it printed 'Exception ignored ... BrokenPipeError' and
  the command exited with status 120."""
  try:
    return entry()
  finally:
    sys.stdout.flush()


def _unencodable_escaped():
  """stdout writes what its encoding cannot hold as \\xe9 escapes, as stderr does: with an
  ASCII stdout (PYTHONIOENCODING=ascii, some ssh or cron set-ups), a file name like 'été.png'
  had ended vit-inspect in a UnicodeEncodeError traceback after its figures were written,
  and vit-predict in one line without its predictions."""
  if sys.stdout is not None and hasattr(sys.stdout, 'reconfigure'):
    sys.stdout.reconfigure(errors='backslashreplace')


# The shell's status for a command whose reader went away (killed by SIGPIPE: 128 + 13).
_READER_GONE_STATUS = 141


def _reader_gone():
  """Output piped into a reader that stopped (`| head`): exit quietly, as a command killed by
  SIGPIPE does, where a traceback of ~20 lines had ended with BrokenPipeError."""
  ctrl_c.discard_unwritten(sys.stdout)
  sys.exit(_READER_GONE_STATUS)


train = _command('vit_jax.main', 'run', takes_signals_over=True)
evaluate = _command('vit_jax.evaluate_cli', 'run_cli')
inspect = _command('vit_jax.inspection', 'run_cli')
predict = _command('vit_jax.predict', 'run_cli')
sweep = _command('vit_jax.launch.sweep', 'main')
vtab = _command('vit_jax.launch.vtab', 'main')
tpu = _command('vit_jax.launch.tpu_vm', 'main')
tfds_build = _command('vit_jax.tfds_build', 'main')
