r"""Entry point: vit-train (python -m vit_jax.main) --config=NAME[:<args>] --workdir=DIR.

Any config field can be overridden: --config.base_lr=0.01 --config.model.dropout_rate=0.1;
--config.model.X takes any field of the model's variant, whether the config lists it or not.
The fields, one comment line each, are in configs/common.py; `--config=NAME --help` prints
that config's fields and values first.
On several hosts the same command runs once per host. On a Cloud TPU VM,
jax.distributed.initialize() finds the other workers from the TPU metadata (on one host
it is harmless); elsewhere pass --coordinator_address, --num_processes and --process_id
(or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID). --workdir may be
gs://...; the readable log then stays on the local disk (--local_log_dir).
"""
import contextlib
import errno
import getpass
import glob
import os
import re
import signal
import sys

from absl import flags
from absl import logging
import ml_collections
from ml_collections import config_flags

from vit_jax import cli_help
from vit_jax import configs
from vit_jax import console_scripts
from vit_jax import cpu_features
from vit_jax import ctrl_c
from vit_jax import errors
from vit_jax import host_allocator
from vit_jax import jax_backend
from vit_jax import parent_death
from vit_jax import paths
from vit_jax import xla_cpu_flags

# JAX, and TensorFlow with rundir, are imported where used: `run` may re-execute the process
# first (host_allocator.py), and should not have paid for them twice.

config_flags.DEFINE_config_file(
    'config', None, 'A packaged config (quickstart, finetune:<model>,<dataset>[,dev], '
    'pretrain:<model>,<dataset>[,<epochs>], table2:<model>[,dev], masked_patches:<model>,<dataset> '
    'or masked_patches:quickstart) or a config file, with its argument after ":".',
    lock_config=True)
flags.DEFINE_string('workdir', None, 'Checkpoints, TensorBoard logs and the log go here.')
flags.DEFINE_string('coordinator_address', os.environ.get('JAX_COORDINATOR_ADDRESS'),
                    'host:port of process 0, for runs on several hosts outside Cloud TPU.')
flags.DEFINE_integer('num_processes',
                     int(os.environ.get('JAX_NUM_PROCESSES', 0)) or None,
                     'Number of processes (hosts).')
flags.DEFINE_integer('process_id', int(os.environ.get('JAX_PROCESS_ID', -1)),
                     'This process\'s index, 0 .. num_processes-1.')
flags.DEFINE_integer(
    'heartbeat_timeout_seconds', 100,
    'On several hosts: a process silent this long is declared dead and the '
    'others exit with an error instead of waiting forever.', lower_bound=1)
flags.DEFINE_enum(
    'distributed', 'auto', ['auto', 'on', 'off'],
    'jax.distributed.initialize(): auto = with --coordinator_address or on a '
    'Cloud TPU VM.')
flags.DEFINE_string(
    'local_log_dir', '~/vit_jax_logs', 'Where the readable log goes when --workdir is not a '
    'local path (per user: a shared /tmp folder of another user\'s is not writable).')
flags.mark_flags_as_required(['config', 'workdir'])
FLAGS = flags.FLAGS


def _on_cloud_tpu_vm():
  # TPU chips appear as /dev/accel* (v2-v4) or /dev/vfio/<n> (v5e and later).
  return bool(glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'))


def initialize_distributed():
  """jax.distributed.initialize() for runs on several hosts (see the module doc)."""
  program = _program(sys.argv)
  if FLAGS.distributed == 'off':
    return
  if FLAGS.coordinator_address:
    _check_process_flags(program)
    _started()
    _initialize(program, FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                heartbeat_timeout_seconds=FLAGS.heartbeat_timeout_seconds)
  elif FLAGS['num_processes'].present or FLAGS['process_id'].present:
    # Without an address each host had trained alone as process 0 of 1, and exited 0.
    sys.exit(f'{program}: --num_processes and --process_id need --coordinator_address=HOST:PORT '
             '(process 0\'s): give all three on every host (a Cloud TPU VM needs none of them)')
  elif FLAGS.distributed == 'on' or _on_cloud_tpu_vm():
    # Addresses and ids come from the TPU metadata (or the cluster's environment).
    _started()
    _initialize(program, heartbeat_timeout_seconds=FLAGS.heartbeat_timeout_seconds)


# JAX settings a user's environment may turn on (JAX_ENABLE_X64=1, ...) that vit-train turns
# off, and why: each had ended a run in a traceback (x64: at step 1, float64 losses against the
# compiled float32 step; disable_jit: the step is compiled ahead of time; debug_nans: an
# uninformative ('jit', 'nan') where the run's guard names the step and the fix).
_THE_GUARD_STOPS = ("the run's own guard stops at the first non-finite loss, gradient or update, "
                    'and says which (--config.on_nonfinite)')
_TURNED_OFF = {
    'jax_enable_x64': 'the run computes in 32 bits as without it (its random draws and its '
                      'types), and resumes the same',
    'jax_disable_jit': 'the train step is compiled ahead of time, which takes jit',
    'jax_debug_nans': _THE_GUARD_STOPS,
    'jax_debug_infs': _THE_GUARD_STOPS,
}
_TURNED_OFF_HERE = []  # (environment variable, its value, why) for the log (_open_log)


def _jax_as_the_run_needs():
  """Turns _TURNED_OFF's settings off where the user's environment turned them on."""
  import jax  # pylint: disable=g-import-not-at-top
  for name, why in _TURNED_OFF.items():
    if getattr(jax.config, name):
      jax.config.update(name, False)
      variable = name.upper()
      _TURNED_OFF_HERE.append((variable, os.environ.get(variable, 'on'), why))


def _check_process_flags(program):
  """--num_processes, --process_id and --coordinator_address fit together, or one line."""
  n, i, address = FLAGS.num_processes, FLAGS.process_id, FLAGS.coordinator_address
  if n is not None and n < 1:
    sys.exit(f'{program}: --num_processes {n} is not a number of hosts: give how many processes '
             'run (one per host)')
  if not n or i < 0:
    missing = [f for f, given in (('--num_processes', n), ('--process_id', i >= 0)) if not given]
    sys.exit(f'{program}: --coordinator_address needs {" and ".join(missing)}')
  if i >= n:
    sys.exit(f'{program}: --process_id {i} is not one of the {n} processes: give each host one '
             f'of 0..{n - 1}')
  host, _, port = address.rpartition(':')
  if not host or not port.isdigit():
    sys.exit(f'{program}: --coordinator_address {address!r} is not HOST:PORT: give process 0\'s '
             'address and a free port, e.g. 10.0.0.2:1234')


def _initialize(program, *args, **kwargs):
  """jax.distributed.initialize, whose refusals (no address found off a TPU VM, ...) are
  one line."""
  import jax  # pylint: disable=g-import-not-at-top
  try:
    jax.distributed.initialize(*args, **kwargs)
  except (ValueError, IndexError) as e:
    sys.exit(
        f'{program}: jax.distributed.initialize: {errors.one_line(e).rstrip(".")}: outside Cloud TPU '
        'and the clusters JAX detects, give --coordinator_address=HOST:PORT, '
        '--num_processes and --process_id (or --distributed=off for one host)')


def _config_value_index(argv):
  """Index of the --config value in argv ('--config=V' or '--config V'), or None; a second
  --config is refused (absl would take the last, on top of the first's overrides)."""
  found = [i for i, arg in enumerate(argv) if arg.startswith(('--config=', '-config='))]
  found += [i + 1 for i, arg in enumerate(argv[:-1]) if arg in ('--config', '-config')]
  if len(found) > 1:
    values = ', '.join(repr(_flag_value(argv[i])) for i in sorted(found))
    raise ValueError(f'--config is given more than once ({values}): give one config and '
                     'set its fields with --config.FIELD=VALUE')
  return found[0] if found else None


def _flag_value(arg):
  """V of '--config=V', or the argument itself (the value after '--config')."""
  return arg.partition('=')[2] if arg.startswith('-') else arg


def parse_flags(argv):
  """absl's flag parsing, with a packaged --config name resolved to its file and every
  mistake (unknown field, bad value, missing file or flag) reported as one line."""
  argv = list(argv)
  config, model_fields = None, {}
  try:
    i = _config_value_index(argv)
    cli_help.check_given_once(argv)  # --workdir, ... (--config: just above, in its words)
    if i is not None:
      value = _flag_value(argv[i])
      argv[i] = argv[i][:len(argv[i]) - len(value)] + configs.resolve(value)
      config = configs.load(value)
      configs.check_overrides_once(argv)
      argv, model_fields = configs.split_model_fields(config, argv)  # added after parsing
      sys.argv[:] = argv  # the config flag reads its --config.x overrides from sys.argv
      configs.check_override_names(config, argv)
      if cli_help.HELP_FLAGS & set(argv):
        print(f'--config={value}: the fields and values it trains with (each overridable as '
              f'--config.FIELD=VALUE):\n\n' + '\n'.join(_field_lines(config)) + '\n')
        print('\n'.join(_variant_lines(config)) + '\n')
    with configs.loading_a_config():
      rest = FLAGS(argv)
      _ = FLAGS.config  # raises if the config file failed to load
    configs.add_model_fields(FLAGS.config, model_fields)
    if config is not None:
      configs.check_model_name_takes_effect(config, FLAGS.config)
    return rest
  except BrokenPipeError:  # --help piped into a reader that stopped: console_scripts' to end
    raise
  except (flags.Error, ValueError, TypeError, OSError, AttributeError, KeyError) as e:
    hint = ''
    if isinstance(e, flags.UnrecognizedFlagError) and config is not None and e.flagname in config:
      hint = f'; config fields are set as --config.{e.flagname}=...'  # big_vision's habit
    sys.exit(f'{_program(argv)}: {errors.plain_value_error(_one_line(e))}{hint} (see --help)')


def _program(argv):
  return errors.PROGRAM if argv[0].endswith('main.py') else os.path.basename(argv[0])  # python -m


def _field_lines(config, prefix=''):
  """'name: value' of every field, nested ones as 'pp.train_crop: inception' (the names
  --config.NAME=VALUE takes); values as typed there, not as YAML tags."""
  for name, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _field_lines(value, f'{prefix}{name}.')
    else:
      yield f'{prefix}{name}: {value if isinstance(value, str) and value else repr(value)}'


def _variant_lines(config):
  """The fields of the config's model that config.model leaves to its variant, with the
  variant's values: --config.model.NAME=VALUE sets them too."""
  from vit_jax.models import variants  # pylint: disable=g-import-not-at-top  (JAX: --help only)
  table = variants.VARIANTS.get(config.model_name, {})
  rest = sorted(set(table) - set(config.model) - {'family'})
  if rest:
    yield (f'The fields of {config.model_name} the config leaves to the model (set as '
           '--config.model.FIELD=VALUE):\n')
    yield from _field_lines(ml_collections.ConfigDict({k: table[k] for k in rest}), 'model.')


def _one_line(error):
  """The line of an error message that says what is wrong (config errors carry a traceback)."""
  lines = [l.strip() for l in str(error).strip().splitlines() if l.strip()]
  if not lines:
    return type(error).__name__
  if 'Traceback' in str(error):  # ml_collections wraps the config's own error
    return re.sub(r'^\w+Error: ', '', lines[-1])
  return lines[0] if len(lines) == 1 else ' '.join(lines[:2])


def _log_dir(workdir):
  """Where the readable log goes: the workdir, or for a gs:// one --local_log_dir (on this
  disk). Resolved at start-up: a '~' that names no home is one line there, not a traceback
  once the run has started."""
  if not paths.is_remote(workdir):
    return workdir
  return paths.resolve_folder_flag(FLAGS.local_log_dir, '--local_log_dir', 'vit_jax_logs')


def _open_log(workdir, log_dir, cpu_devices):
  """The readable log in log_dir: train.INFO (process 0), train.process<i>.INFO (the others),
  and the lines that say what this process runs on (`cpu_devices`: why the CPU backend has
  the devices it has)."""
  import jax  # pylint: disable=g-import-not-at-top
  try:
    os.makedirs(log_dir, exist_ok=True)
  except OSError as e:
    sys.exit(f'{errors.PROGRAM}: cannot create {log_dir} ({e.strerror}): choose another --workdir'
             + (' or --local_log_dir' if log_dir != workdir else ''))
  name = 'train' if jax.process_index() == 0 else f'train.process{jax.process_index()}'
  try:
    with _named_for_absl():
      logging.get_absl_handler().use_absl_log_file(name, log_dir)
  except OSError as e:  # absl: "Can't find a writable directory for logs"
    sys.exit(f'{errors.PROGRAM}: cannot write the log in {log_dir} ({errors.one_line(e)}): fix its '
             'permissions or choose another --workdir'
             + (' or --local_log_dir' if log_dir != workdir else ''))
  without_link = _log_to_the_link_itself(log_dir, name)
  FLAGS.alsologtostderr = True
  if without_link:
    logging.info('%s', without_link)
  logging.info('process %d/%d, %d local / %d global devices (%s)', jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count(),
               jax.devices()[0].platform)
  for variable, value, why in _TURNED_OFF_HERE:
    logging.info('%s=%s: off for this run: %s', variable, value, why)
  if jax.devices()[0].platform == 'cpu':
    logging.info('CPU devices: %d (%s)', jax.local_device_count(), cpu_devices)
    logging.info('%s', xla_cpu_flags.last_choice)
    logging.info('%s', host_allocator.describe())
    if note := cpu_features.bf16_note(FLAGS.config.dtype):
      logging.warning('%s', note)


@contextlib.contextmanager
def _named_for_absl():
  """absl names the log after getpass.getuser(). For a user without a name (a container's
  uid with no passwd entry, none of LOGNAME, USER, LNAME, USERNAME set) Python 3.13 raises
  OSError, not the KeyError on which absl takes the uid: vit-train had stopped with 'cannot
  write the log ... (No username set in the environment)'. LOGNAME is the uid meanwhile."""
  try:
    getpass.getuser()
    named = True
  except (OSError, KeyError):
    named = False
  if named:
    yield
    return
  os.environ['LOGNAME'] = str(os.getuid())
  try:
    yield
  finally:
    del os.environ['LOGNAME']


def _log_to_the_link_itself(log_dir, name):
  """Where `name`.INFO cannot be a symbolic link to the log absl just opened (Google Drive in
  Colab, SMB and FAT folders refuse links; absl then goes on without one), the log is written
  to `name`.INFO itself, after the runs before it, so that `tail -f W/train.INFO` and the
  README's stops follow this run on every filesystem. Returns the line that says so, or None
  where the link is there."""
  handler = logging.get_absl_handler().python_handler
  own = handler.stream.name
  link = os.path.join(log_dir, f'{name}.INFO')
  if os.path.realpath(link) == os.path.realpath(own):
    return None
  try:
    if os.path.islink(link):  # one absl could not replace (another user's): not written through
      raise PermissionError(errno.EPERM, 'a link this user cannot replace', link)
    stream = open(link, 'a', encoding='utf-8')  # pylint: disable=consider-using-with
  except OSError as e:
    return (f'{name}.INFO could not be linked to this log, nor written ({errors.one_line(e)}): '
            f'this run logs to {os.path.basename(own)}')
  handler.stream.close()
  with contextlib.suppress(OSError):
    os.remove(own)  # opened by absl, still empty
  handler.stream = stream
  return (f'{name}.INFO cannot be a link to this run\'s log ({log_dir} takes no symbolic links, '
          'or it was made as a plain file), so each run\'s log is appended to it')


def main(argv):
  global _workdir  # pylint: disable=global-statement  (for a signal's last line)
  cli_help.refuse_arguments(_program(argv), argv,
                            'a folder is --workdir=DIR, a config --config=NAME')
  # The first import of jax: a signal handler's exception raised inside jaxlib's extension
  # initialisation became an ImportError traceback or a crash (SIGSEGV); held, it lands after.
  with ctrl_c.held(signal.SIGTERM, signal.SIGHUP):
    from vit_jax import config_checks  # pylint: disable=g-import-not-at-top
  try:
    # Before TensorFlow and the backend start: a mistyped value is one line in ~2 s, not ~9.
    workdir = paths.resolve_run_folder(FLAGS.workdir)  # once: orbax refuses relative paths
    _workdir = workdir
    log_dir = _log_dir(workdir)
    config_checks.validate_before_devices(FLAGS.config)
  except ValueError as e:
    sys.exit(f'{errors.PROGRAM}: {e}')
  # pylint: disable=g-import-not-at-top,unused-import
  from vit_jax import tensorflow_quietly  # noqa: F401  (before rundir imports TensorFlow)
  from vit_jax import rundir
  # pylint: enable=g-import-not-at-top,unused-import
  recorded = rundir.recorded_cpu_flags(workdir)  # a resumed run keeps its CPU kernels
  from vit_jax import sharding  # pylint: disable=g-import-not-at-top
  try:
    # Before the backend starts; logged below, once the log file is open.
    xla_cpu_flags.apply(dtype=FLAGS.config.dtype, recorded=recorded, log=False)
    cpu_devices = sharding.split_host_cpu(FLAGS.config)
  except ValueError as e:  # a bad VIT_JAX_XLA_CPU_FLAGS or cpu_devices value
    sys.exit(f'{errors.PROGRAM}: {e}')
  _jax_as_the_run_needs()
  initialize_distributed()
  jax_backend.exit_if_it_cannot_start(errors.PROGRAM)  # before a lock or log is written
  from vit_jax import train  # pylint: disable=g-import-not-at-top  (after distributed init)
  _started()
  log_open = []

  def open_log():
    _open_log(workdir, log_dir, cpu_devices)
    log_open.append(True)

  try:
    # The log opens once the workdir is this run's: a run refused there (in use, another
    # config) leaves the log of the run that owns it as train.INFO.
    train.train_and_evaluate(FLAGS.config, workdir, on_start=open_log)
  except train.ConfigError as e:  # TrainingError's status: 1, or a signal's
    _exit_with(f'{errors.PROGRAM}: {e}', log_open, getattr(e, 'status', 1))
  except Exception as e:  # pylint: disable=broad-except
    _exit_if_a_peer_failed(e)
    raise
  except train.PreemptedOutsideTheLoop:
    _exit_outside_the_loop(signal.SIGTERM, log_open)
  except train.TerminalClosedOutsideTheLoop:
    _exit_outside_the_loop(signal.SIGHUP, log_open)
  except KeyboardInterrupt:  # before the loop's own handler (restore, compile, data set-up)
    _exit_outside_the_loop(signal.SIGINT, log_open)


# A signal outside the training steps (start-up, set-up, restore, compile, wrap-up): the one
# line, what happened and then what is left (by whether the workdir holds results). The exit
# status is the shell's for the signal (128 + its number), as in the loop.
_STOPPED_OUTSIDE_THE_LOOP = {
    signal.SIGTERM: 'preempted (SIGTERM) outside the training steps (set-up, compile or wrap-up)',
    signal.SIGHUP: ('the terminal closed (SIGHUP) outside the training steps (set-up, compile '
                    'or wrap-up)'),
    signal.SIGINT: 'interrupted (Ctrl-C) before training started',
}
_LEFT_IN_THE_WORKDIR = {
    True: 'the saved checkpoints are kept; run the same command to resume',
    False: 'nothing was saved; run the same command to start again',
    None: 'nothing new was saved; run the same command again',  # the workdir not looked at yet
}
_workdir = None  # the run's, once main has resolved it


def exit_line(signum, saved=None):
  """The last line of a run that `signum` stopped outside the training steps; `saved`:
  whether its workdir holds checkpoints or a final.npz (None: not known yet)."""
  hint = ' (under nohup, tmux or screen a run outlives its terminal)'
  return (f'{errors.PROGRAM}: {_STOPPED_OUTSIDE_THE_LOOP[signum]}: {_LEFT_IN_THE_WORKDIR[saved]}' +
          (hint if signum == signal.SIGHUP else ''))


def _saved():
  """Whether the run's workdir holds results (None where it was not resolved yet, or
  cannot be read; TensorFlow is not imported for it)."""
  rundir = sys.modules.get('vit_jax.rundir')
  if _workdir is None or rundir is None:
    return None
  try:
    return bool(rundir.has_results(_workdir))
  except Exception:  # pylint: disable=broad-except  (a gs:// error: say what is sure)
    return None


def _exit_outside_the_loop(signum, log_open):
  """Ends the run with exit_line's line for `signum`, status 128 + `signum`."""
  _exit_with(exit_line(signum, _saved()), log_open, 128 + signum)


class _StoppedWhileStarting(BaseException):
  """A signal before train_and_evaluate took the signals over (nothing written yet)."""

  def __init__(self, signum):
    super().__init__(signum)
    self.signum = signum


# The signals received while starting. The handler's exception is lost where one lands in a
# garbage-collection callback (JAX's, as TensorFlow imports) or a __del__: _started raises
# it again.
_RECEIVED_WHILE_STARTING = []


def _stopped_while_starting(signum, frame):
  del frame
  if signum != signal.SIGINT:  # a second Ctrl-C is the user's; a second SIGTERM is not news
    signal.signal(signum, signal.SIG_IGN)
  _RECEIVED_WHILE_STARTING.append(signum)
  raise _StoppedWhileStarting(signum)


def _stop_while_starting():
  """SIGTERM, SIGHUP and Ctrl-C end the start-up (imports, TensorFlow's ~2 s, the config
  checks) with their one line: SIGTERM and SIGHUP had killed it silently (status 143, 129)
  and Ctrl-C printed a traceback. A signal ignored from the start (nohup's SIGHUP, a
  background job's Ctrl-C) stays ignored."""
  for sig in _STOPPED_OUTSIDE_THE_LOOP:
    if signal.getsignal(sig) != signal.SIG_IGN:
      signal.signal(sig, _stopped_while_starting)
  shown = sys.unraisablehook

  def lost_ones_unshown(unraisable):  # "Exception ignored in: <gc callback>": _started has it
    if not isinstance(unraisable.exc_value, _StoppedWhileStarting):
      shown(unraisable)

  sys.unraisablehook = lost_ones_unshown
  # One that came while the console script imported this module (vit_jax/console_scripts.py)
  # or host_allocator re-executed the process waited, blocked: now it lands.
  signal.pthread_sigmask(signal.SIG_UNBLOCK, list(_STOPPED_OUTSIDE_THE_LOOP))


def _started():
  """Python's own handlers back, for train_and_evaluate's; also before a multi-host
  start-up's jax.distributed.initialize, which a Python handler could not interrupt."""
  defaults = {signal.SIGINT: signal.default_int_handler}
  for sig in _STOPPED_OUTSIDE_THE_LOOP:
    if signal.getsignal(sig) is _stopped_while_starting:
      signal.signal(sig, defaults.get(sig, signal.SIG_DFL))
  if _RECEIVED_WHILE_STARTING:  # received, but its exception was lost
    raise _StoppedWhileStarting(_RECEIVED_WHILE_STARTING[0])


def _exit_with(message, log_open, status=1):
  """Exit `status` with `message` as stderr's last line, and train.INFO's once it is open
  (where the user of a closed terminal, or of a preempted TPU VM, looks)."""
  if log_open:
    FLAGS.alsologtostderr = False  # stderr gets it once, below
    logging.error('%s', message)
    logging.flush()
  ctrl_c.stop_with(message, status, abandoned=_a_save_thread)


def _a_save_thread(thread):
  """Whether `thread` is one of orbax's threads of a save (those of a save that failed
  before it began wait for it for minutes: the exit does not wait for them). Orbax's other
  threads, stopped at Python's exit, are plain threading.Threads."""
  return type(thread).__module__.startswith('orbax.')


def _exit_if_a_peer_failed(error):
  """On several processes, a runtime error (most often: a collective whose peer process
  died) is one line and exit status 1. Python's own exit would shut the distributed runtime
  down, which aborts the process (status 134) with a page of C++ stack and no word of what
  to do."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_count() == 1 or not isinstance(error, jax.errors.JaxRuntimeError):
    return
  logging.flush()
  sys.stderr.write(
      f'{errors.PROGRAM}: process {jax.process_index()} of {jax.process_count()} stopped: '
      f'{errors.one_line(re.sub(r"(Error dispatching computation: )+", "", str(error)))}'
      '; if another process stopped (killed, preempted or crashed: see its log), '
      'start every process again with the same command: they resume from the last '
      'checkpoint\n')
  sys.stderr.flush()
  os._exit(1)  # pylint: disable=protected-access  (skips the shutdown that aborts)


def run():
  """The `vit-train` console script."""
  console_scripts.prepare_the_process()  # again for `python -m vit_jax.main`
  try:
    _stop_while_starting()
    parent_death.stop_with_the_starter()  # a SIGTERM from here on ends it with its one line
    try:
      host_allocator.reexec_with_jemalloc()  # before JAX starts: see host_allocator.py
    except ValueError as e:  # a bad VIT_JAX_HOST_ALLOCATOR value
      sys.exit(f'{errors.PROGRAM}: {e}')
    cli_help.run(main, __name__, program=errors.PROGRAM, flags_parser=parse_flags)
  except _StoppedWhileStarting as stopped:
    _exit_outside_the_loop(stopped.signum, log_open=[])


if __name__ == '__main__':
  run()
