r"""Hyper-parameter sweeps: one vit_jax.main run per grid point, then a summary table.

  vit-sweep --config=finetune:ViT-B_16,cifar10,dev --workdir=DIR
      [--sweep 'config.base_lr=[0.001,0.003,0.01,0.03]'] [--sweep 'config.x=[...]' ...]
      [--set config.total_steps=100 ...] [--tpu NAME --zone Z [--project P]]
      [--dry-run] [--summarize-only]

(python -m launch.sweep in a checkout is the same.)

Without --sweep the grid is the config's lr_grid over base_lr (Table 4). Several --sweep
flags form the cartesian product. Point p runs in DIR/<p> (p like 'base_lr=0.003'; cut to
255 bytes, see fitted), locally one after another (output also in DIR/<p>/sweep.log, line by
line; a failed point is recorded and the sweep goes on; Ctrl-C, SIGTERM or SIGHUP stop it
once the running point has saved), or with --tpu one after another in the background on every
worker of a TPU VM (see launch/tpu_vm.py; DIR must then be gs://). Before any point
runs, each point's config goes through vit-train's start-up checks (preflight), and for a
local sweep its data is checked as vit-train checks it (check_data). The summary reads the
'accuracy' scalars of each point's TensorBoard events and writes DIR/summary.md and
DIR/summary.csv; the winner is the point with the best final accuracy, as the paper
picks the learning rate on the held-out development split, and the summary's last line says
whether its eval split was held out of the training data (then: the final run's command line,
on all of it) or not (then: how to hold data out). As a sweep starts it records its
--config, grid and --set flags in DIR/sweep.json: --summarize-only reads the points and the
winner's command line from there, so it needs only --workdir. A DIR whose sweep.json records
another sweep (its --config, grid or --set flags differ; 1e-3 and 0.001 are the same) is
refused, --dry-run too, before anything is written; the same flags resume that sweep.
"""
import argparse
import ast
import contextlib
import csv
import hashlib
import io
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

from vit_jax import cli_help
from vit_jax import console_scripts
from vit_jax import configs
from vit_jax import ctrl_c
from vit_jax import errors
from vit_jax import jax_backend
from vit_jax import parent_death
from vit_jax import paths
from vit_jax.launch import tpu_vm

COLUMNS = ('point', 'status', 'final_accuracy', 'best_accuracy', 'steps')
RECORD = 'sweep.json'  # DIR/sweep.json: the --config, grid and --set flags the points run with
NAME_BYTES = 255  # The longest file name Linux filesystems take (NAME_MAX), in UTF-8 bytes.


class SweepError(Exception):
  """A bad argument; main prints it as one line."""


class SweepInterrupted(Exception):
  """Ctrl-C, SIGTERM or SIGHUP during a point's (or a VTAB task's) run; main prints it as one
  line and exits with `status`, the shell's for that signal."""

  def __init__(self, message, status):
    super().__init__(message)
    self.status = status


def interrupted(interrupt, kind, index, count, name, resumes):
  """The SweepInterrupted of `interrupt` (a KeyboardInterrupt, ctrl_c.Stopped too) during run
  `index` (from 0) of `count`, `name`; the same command `resumes` (what)."""
  return SweepInterrupted(
      f"{ctrl_c.what(interrupt)} at {kind} {index + 1}/{count}, {name} (its run's last line "
      f'above says what it saved): run the same command to resume {resumes}',
      ctrl_c.status(interrupt))


def _key(text, flag):
  """'config.model.dropout_rate' -> 'model.dropout_rate' (the prefix is optional)."""
  key = text.strip()
  key = key[len('config.'):] if key.startswith('config.') else key
  if not re.fullmatch(r'[A-Za-z_]\w*(\.[A-Za-z_]\w*)*', key):
    raise SweepError(f'{flag} {text!r}: the key must look like config.base_lr')
  return key


def _value(text):
  """A Python literal where it is one ('0.01', '3', 'True', '(1, 2)'), else the string."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def parse_sweep(spec):
  """"config.base_lr=[0.001,0.003]" -> ('base_lr', [0.001, 0.003]); strings may be bare."""
  usage = f"--sweep {spec!r}: write it as 'config.KEY=[v1,v2,...]'"
  key, sep, values = spec.partition('=')
  values = values.strip()
  if not sep or not (values.startswith('[') and values.endswith(']')):
    raise SweepError(usage)
  key = _key(key, '--sweep')
  parsed = _value(values)
  if not isinstance(parsed, list):  # Bare strings: split at the commas.
    parsed = [_value(v.strip()) for v in values[1:-1].split(',')]
  if not parsed or any(v == '' for v in parsed):
    raise SweepError(f'{usage} (with at least one value, none empty)')
  return key, parsed


def parse_set(spec):
  """"config.total_steps=100" -> ('total_steps', '100') (passed through as text)."""
  key, sep, value = spec.partition('=')
  if not sep:
    raise SweepError(f"--set {spec!r}: write it as 'config.KEY=VALUE'")
  return _key(key, '--set'), value


def load_config(config):
  """The ConfigDict of a --config value (file or packaged name), as vit_jax.main builds it."""
  try:
    return configs.load(config)
  except configs.ConfigNotFoundError as e:
    raise SweepError(str(e)) from None
  except Exception as e:  # pylint: disable=broad-except  (the config's own message)
    raise SweepError(f'--config {config!r}: {e}') from None


def _has_field(config, key):
  node = config
  for part in key.split('.'):
    if not hasattr(node, 'keys') or part not in node.keys():
      return False
    node = node[part]
  return True


_BOOLEANS = ('true', 't', '1', 'false', 'f', '0')  # what vit-train's bool fields take


def check_value(config, key, text):
  """SweepError if `text` cannot set the field `key` (by the type of its value in the config),
  as vit-train would refuse it: at start-up, not after the points before it have trained."""
  node = config
  for part in key.split('.'):
    node = node[part]
  if isinstance(node, bool):
    ok, want = text.strip().lower() in _BOOLEANS, 'true or false'
  elif isinstance(node, (int, float)):
    want = 'an integer' if isinstance(node, int) else 'a number'
    try:
      (int if isinstance(node, int) else float)(text)
      ok = True
    except ValueError:
      ok = False
  else:
    return  # strings, tuples, None: vit-train's own checks
  if not ok:
    raise SweepError(f'config.{key}={text}: expected {want}')


def point_configs(config, sets, points):
  """[(point name, its ConfigDict)], as vit-train builds each point's config."""
  out = []
  for name, assignments in points:
    try:
      out.append((name, tpu_vm.load_config(config, overrides(sets, assignments))))
    except tpu_vm.LaunchError as e:
      raise SweepError(f'point {name}: {e}') from None
  return out


def _as_given(message, config_flag, swept):
  """`message` with each --config.FIELD written as this command takes it: `config_flag`FIELD
  (vit-sweep: --set config.; vit-vtab: --config.), or --sweep config.FIELD for a swept one."""

  def as_given(match):
    field = match.group(1)
    return f'--sweep config.{field}' if field in swept else f'{config_flag}{field}'

  return re.sub(r'--config\.([\w.]+)', as_given, message)


def preflight(configs_of_points, what='point', config_flag='--set config.', swept=()):
  """vit-train's start-up checks (config_checks) of every point's config, so that a
  value only a later point has (a string, a tuple, a range) stops the sweep before the first
  point trains. The devices are not counted here, so that this process does not take the
  accelerator its points need: each point checks its batch against them at its start.
  `what` names a point in the message (vit-vtab's are tasks); `config_flag` and `swept`
  as for _as_given."""
  for name, c in configs_of_points:
    try:
      tpu_vm.validate_for_slice(c, None)
    except tpu_vm.LaunchError as e:
      raise SweepError(f'{what} {name}: {_as_given(str(e), config_flag, swept)}') from None


def check_data(configs_of_points, what='point', config_flag='--set config.', swept=()):
  """The datasets of points that run here, as vit-train checks them at its start (prepared,
  splits that exist and hold examples), once per dataset and splits: a dataset not built
  stops the sweep before its first point, not every point in turn, and the datasets not
  prepared are named together, in one `vit-tfds-build`. Arguments as for preflight."""
  # pylint: disable=g-import-not-at-top,unused-import
  from vit_jax import tensorflow_quietly  # noqa: F401  (TF without its start-up notices)
  from vit_jax import data_sources
  from vit_jax import input_pipeline  # (loads TF)
  # pylint: enable=g-import-not-at-top,unused-import
  not_prepared = {}  # {key: the NotPrepared error}
  missing = {}  # {data_dir: {point: its NotPrepared error}}
  for name, c in configs_of_points:
    key = (c.dataset, c.data_dir, c.train_split, c.eval_split, c.num_train_examples)
    if key not in not_prepared:
      try:
        input_pipeline.get_info(c)
        input_pipeline.validate_splits(c)
        not_prepared[key] = None
      except data_sources.NotPrepared as e:
        not_prepared[key] = e
      except (ValueError, FileNotFoundError) as e:
        message = _as_given(errors.one_line(e), config_flag, swept)
        raise SweepError(f'{what} {name}: {message}') from None
    if not_prepared[key]:
      missing.setdefault(not_prepared[key].data_dir, {})[name] = not_prepared[key]
  for data_dir, by_point in missing.items():
    if len({e.name for e in by_point.values()}) == 1:  # one dataset: the first point's line
      name, e = next(iter(by_point.items()))
      raise SweepError(f'{what} {name}: {_as_given(str(e), config_flag, swept)}')
    raise SweepError(
        f'{len(by_point)} {what}s\' datasets are not prepared in data_dir {data_dir} '
        f'({", ".join(by_point)}): {data_sources.build_advice(list(by_point.values()))}, or set '
        + _as_given('--config.data_dir to where they are prepared', config_flag, swept))


def build_grid(config, sweeps):
  """[(key, values)] from the --sweep specs, or the config's lr_grid over base_lr."""
  if sweeps:
    grid = [parse_sweep(s) for s in sweeps]
  else:
    lr_grid = list(config.get('lr_grid', ()) or ())
    if not lr_grid:
      raise SweepError("the config has no lr_grid: pass --sweep 'config.base_lr=[...]'")
    grid = [('base_lr', [float(v) for v in lr_grid])]
  keys = [k for k, _ in grid]
  for key in keys:
    if keys.count(key) > 1:
      raise SweepError(f'config.{key} is swept twice: merge the --sweep flags')
  return grid


def format_value(value):
  """How a value is written on the command line (and in the point name)."""
  if isinstance(value, float):
    return repr(value)
  if isinstance(value, (tuple, list)):
    return str(tuple(value))
  return str(value)


def point_name(assignments):
  """'base_lr=0.003,warmup_steps=100', with anything unsafe in a file name made '_', fitted to
  a folder name's length."""
  name = ','.join(f'{k}={format_value(v)}' for k, v in assignments)
  return fitted(re.sub(f'[^{tpu_vm.LOG_NAME_CHARS}]', '_', name), NAME_BYTES)


def fitted(name, limit):
  """`name`, or where its UTF-8 is longer than `limit` bytes, as much of its start as fits
  before '+' and 12 hex digits of its SHA-256: a grid of many swept keys (or long values)
  still has one folder per point, named the same on every run of the sweep."""
  data = name.encode()
  if len(data) <= limit:
    return name
  digest = hashlib.sha256(data).hexdigest()[:12]
  return data[:limit - len(digest) - 1].decode(errors='ignore') + '+' + digest


def grid_points(grid):
  """[(name, [(key, value), ...])] over the cartesian product, in grid order."""
  keys = [k for k, _ in grid]
  points = [(point_name(list(zip(keys, combo))), list(zip(keys, combo)))
            for combo in itertools.product(*(v for _, v in grid))]
  names = [n for n, _ in points]
  twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
  if twice is not None:
    same = [assignments for n, assignments in points if n == twice][:2]
    if same[0] == same[1]:
      raise SweepError(f'the grid holds point {twice} twice: a swept value is listed twice (as '
                       '0.001 and 1e-3 would be, one number): list each value once')
    values = ' and '.join(', '.join(f'{k}={v!r}' for k, v in a) for a in same)
    raise SweepError(f'two grid points share the name {twice} ({values}): make the swept values '
                     'distinct')
  return points


def overrides(sets, assignments):
  """--config.x=... flags: the --set ones, then the point's."""
  return ([f'--config.{k}={v}' for k, v in sets]
          + [f'--config.{k}={format_value(v)}' for k, v in assignments])


def point_argv(config, workdir, sets, name, assignments, python=sys.executable):
  return [
      python, '-P', '-m', 'vit_jax.main', f'--config={config}', f'--workdir={join(workdir, name)}',
      *overrides(sets, assignments)
  ]


def join(directory, name):
  return directory.rstrip('/') + '/' + name if '://' in directory else os.path.join(directory, name)


def tpu_commands(args, config, workdir, sets, points):
  """One ssh to all workers: the points run one after another in the background."""
  if not workdir.startswith('gs://'):
    raise SweepError('--tpu needs --workdir=gs://BUCKET/..., where this machine can read the '
                     'results')
  config, _ = tpu_vm.remote_config(config)  # As the workers name it; none outside the tree.
  jobs = [(tpu_vm.train_argv(config, join(workdir, name), overrides(sets, assignments)),
           fitted(f'sweep-{name}', tpu_vm.LOG_NAME_BYTES)) for name, assignments in points]
  return [tpu_vm.ssh(args, 'all', tpu_vm.start_script(jobs))]


def check_workdir(workdir, create):
  """A workdir the points cannot be written under stops the sweep before its first point
  (created here where `create`; else only refused where a file is in the way)."""
  try:
    if create:
      paths.make_workdir(workdir)
    else:
      paths.check_not_a_file(workdir)
  except ValueError as e:
    raise SweepError(str(e)) from None


def run_local(argv, log_path, env=None):
  """Runs one point, streaming its output to stdout and to log_path; returns the exit code.
  On Ctrl-C, which the terminal sends the point's vit-train too (one process group), the
  point saves a checkpoint and exits: its last lines are streamed before the
  KeyboardInterrupt goes on (a second Ctrl-C stops both at once). SIGTERM and SIGHUP, where
  run_sweep takes them (ctrl_c.Stopped), are passed on to the point, then the same."""
  # Each line is in a local log, then on the console, as it comes (`tail -f` follows the
  # log); a remote log is written whole as it closes.
  live = not paths.is_remote(log_path)
  # A local log gains each run of the point (one resumed after Ctrl-C: both parts); GCS
  # has no append, so a remote one holds the last.
  with paths.open_file(log_path, 'a' if live else 'w') as log:
    log.write(f'== {shlex.join(argv)}\n')
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=parent_death.environment_for_run(env))

    def stream():
      shown = True
      for line in proc.stdout:
        log.write(line)
        if live:
          log.flush()
        if shown:
          try:
            sys.stdout.write(line)
            sys.stdout.flush()
          except OSError:  # a closed terminal (SIGHUP): the point still saves, its log goes on
            shown = False

    # The copy runs in its own thread, which Ctrl-C never interrupts: raised in the main
    # thread's copy, it could land after a line was read and before it was written, and
    # that line (the point's "checkpoint saved") was lost.
    copy = threading.Thread(target=stream, daemon=True)
    copy.start()
    try:
      status = proc.wait()
    except KeyboardInterrupt as e:
      if isinstance(e, ctrl_c.Stopped):  # sent to this process alone (docker stop, kill PID)
        proc.send_signal(e.signum)
      proc.wait()
      raise
    finally:
      copy.join()
    return status


# How long a sweep run again after it was killed waits for the point it had been running to
# save and exit (it was sent SIGTERM as the sweep died), before running that point anyway.
STOPPING_POINT_WAIT_S = 300


def wait_for_a_stopping_run(run_dir, log_name, out, killed='vit-sweep',
                            timeout_s=STOPPING_POINT_WAIT_S):
  """Waits while a run on this host holds `run_dir`'s lock, up to `timeout_s`: in a sweep or
  vit-vtab that took over the lock of one killed outright (held), the run that one had
  started may still be saving; started beside it, the point's vit-train was refused and the
  point marked failed. `killed`: the command that was killed. What it says goes to `out` and
  to the point's log `log_name` in `run_dir`, which the killed command had been writing: that
  log then says how its run ended."""
  # pylint: disable-next=g-import-not-at-top  (JAX and TensorFlow: for a local run only)
  from vit_jax import rundir
  lock = rundir.WorkdirLock(run_dir, process_index=0)
  holder = lock.training_now(this_host_only=True)
  if holder is None:
    return

  def say(line):
    print(line, file=out, flush=True)
    with contextlib.suppress(OSError):  # a full disk: the point's own run then says so
      with open(os.path.join(run_dir, log_name), 'a') as log:
        log.write(line + '\n')

  say(f'== waiting up to {timeout_s // 60} minutes for {holder} to save and exit: the {killed} '
      'before this one was killed, and its run there was sent SIGTERM')
  deadline = time.monotonic() + timeout_s
  try:
    while lock.training_now(this_host_only=True) and time.monotonic() < deadline:
      time.sleep(1)
  except KeyboardInterrupt as e:
    raise SweepInterrupted(
        f'{ctrl_c.what(e)} while waiting for {holder} to save and exit (it goes on): run the '
        'same command to resume, once it has exited', ctrl_c.status(e)) from None
  if lock.training_now(this_host_only=True):
    say(f'== {holder} still runs after {timeout_s // 60} minutes: the point is started anyway')
  else:
    say(f'== it exited; its log ends: {last_logged_line(run_dir)}')


def last_logged_line(run_dir, tail_bytes=65536):
  """The last line of the log in `run_dir` (a local run's train.INFO), without absl's
  prefix: what a run said last, read from the file's last `tail_bytes`."""
  path = os.path.join(run_dir, 'train.INFO')
  try:
    with open(path, 'rb') as log:
      log.seek(max(0, os.fstat(log.fileno()).st_size - tail_bytes))
      lines = log.read().decode(errors='replace').splitlines()
  except OSError as e:
    return f'(cannot read {path}: {e.strerror})'
  last = next((line for line in reversed(lines) if line.strip()), '(nothing)')
  return re.sub(r'^[IWEF]\d{4} [\d:.]+ +\d+ [^\]]*\] ', '', last)


@contextlib.contextmanager
def held(workdir):
  """DIR/lock (vit-train's WorkdirLock) while a local sweep, or vit-vtab, runs its points: a
  second one started in the same DIR had run on beside the first, recorded the point the
  first was running as failed (its vit-train refused by the point's lock), and each had then
  reported failures that were not. Yields whether it took over the lock of one that was
  killed outright (its running point may still be saving: wait_for_a_stopping_run)."""
  # pylint: disable-next=g-import-not-at-top  (JAX and TensorFlow: for a local run only)
  from vit_jax import rundir
  # Not JAX's process_index(): a backend that cannot start is each point's line to say.
  lock = rundir.WorkdirLock(workdir, process_index=0)
  try:
    lock.acquire()
  except errors.ConfigError as e:
    raise SweepError(str(e)) from None
  try:
    yield lock.took_over is not None
  finally:
    lock.release()


def run_sweep(config, workdir, sets, points, runner=run_local, out=None):
  """Runs every point in sequence; returns {name: status}. A failure does not stop it."""
  out = out or sys.stdout
  statuses = {}
  with held(workdir) as after_a_killed_sweep, ctrl_c.terminate_like_ctrl_c():
    for i, (name, _) in enumerate(points):
      statuses[name] = _run_point(config, workdir, sets, points, i, runner, out,
                                  after_a_killed_sweep)
  return statuses


def _run_point(config, workdir, sets, points, i, runner, out, after_a_killed_sweep=False):
  """Runs point `i` of `points`; returns its status (also written to its sweep_status)."""
  name, assignments = points[i]
  argv = point_argv(config, workdir, sets, name, assignments)
  # Finished under these flags (check_same_sweep): run again, it would only evaluate again.
  point_dir = join(workdir, name)
  if _read_status(point_dir) == 'ok' and paths.exists(join(point_dir, 'final.npz')):
    print(f'== sweep point {i + 1}/{len(points)}: {name}: finished (final.npz), skipped', file=out,
          flush=True)
    return 'ok'
  print(f'== sweep point {i + 1}/{len(points)}: {name}\n{shlex.join(argv)}', file=out, flush=True)
  try:
    paths.make_workdir(point_dir, flag='--workdir')
  except ValueError as e:  # a full disk, a file of the point's name in the way
    raise SweepError(f'point {name}: {e}') from None
  if after_a_killed_sweep:
    wait_for_a_stopping_run(point_dir, 'sweep.log', out)
  try:
    rc = runner(argv, join(point_dir, 'sweep.log'))
  except OSError as e:
    rc = f'{type(e).__name__}: {e}'
  except KeyboardInterrupt as e:
    raise interrupted(e, 'point', i, len(points), name,
                      'the sweep, each point from its last checkpoint') from None
  status = point_status(rc)
  with paths.open_file(join(point_dir, 'sweep_status'), 'w') as f:
    f.write(status + '\n')
  print(f'== {name}: {status}{why_killed(rc)}', file=out, flush=True)
  if rc != 0:
    stop_if_every_point_would_fail(join(point_dir, 'sweep.log'), 'point', name)
  return status


def point_status(rc):
  """'ok', 'failed (exit N)', or for a point a signal killed (runner's -N) 'failed (SIGKILL)';
  an OSError's text where it could not start."""
  if rc == 0:
    return 'ok'
  if isinstance(rc, int) and rc < 0:
    with contextlib.suppress(ValueError):
      return f'failed ({signal.Signals(-rc).name})'
  return f'failed (exit {rc})'


def why_killed(rc, flag='--set config.', in_another_workdir=True):
  """What a point's status line adds where SIGKILL ended it: its own log ends mid-run,
  without a line, and the sweep's had said only 'exit -9'. `flag`: how the command sets a
  field of every point; `in_another_workdir`: whether that takes another DIR (a sweep's DIR
  keeps its --set flags)."""
  if rc != -signal.SIGKILL:
    return ''
  where = 'in another --workdir, ' if in_another_workdir else ''
  return (': the kernel\'s out-of-memory killer ends processes with SIGKILL (`dmesg | grep -i '
          f'killed` tells whether it did); {where}{flag}accum_steps=0 (the fewest micro-batches '
          f'that fit) or {flag}remat=True trains in less memory')


def stop_if_every_point_would_fail(log_path, what, name):
  """SweepError where the failed point's log ends with a failure that every later point
  would meet too: JAX's backend cannot start (JAX_PLATFORMS naming a runtime that is not
  installed, a TPU another process holds). Each point had failed in turn with the same line.
  `what` names a point in the message (vit-vtab's are tasks), `name` this one."""
  try:
    with paths.open_file(log_path, 'r') as f:
      lines = f.read().strip().splitlines()
  except Exception:  # pylint: disable=broad-except  (unreadable: the summary tells the rest)
    return
  said = lines[-1].removeprefix('vit-train: ') if lines else ''
  if said.startswith(jax_backend.CANNOT_START):
    raise SweepError(f'{what} {name}: {said} (stopped here: the later {what}s would fail the same '
                     'way)')


def _written_order(path):
  """An event file's place in writing order. Its name is events.out.tfevents.<seconds>.<host>
  .<pid>.<n>.v2, n counting the writers of that process: as text, n=10 sorts before n=9."""
  numbers = [int(f) for f in os.path.basename(path).split('.')[3:] if f.isdigit()]
  return (numbers[0], numbers[-1], path) if numbers else (0, 0, path)


def read_accuracy(directory, tag='accuracy'):
  """[(step, value)] of a scalar in the TensorBoard event files of a directory."""
  # pylint: disable=g-import-not-at-top,unused-import  (slow; only for the summary)
  from vit_jax import tensorflow_quietly  # noqa: F401  (TF without its start-up notices)
  import tensorflow as tf
  # pylint: enable=g-import-not-at-top,unused-import
  try:  # listed, not globbed: a '*', '?' or '[' in the directory would be a pattern
    names = [n for n in tf.io.gfile.listdir(directory) if n.startswith('events.out.tfevents.')]
  except tf.errors.NotFoundError:
    names = []
  values = {}
  for path in sorted((join(directory, n) for n in names), key=_written_order):
    try:
      for record in tf.data.TFRecordDataset(path):
        event = tf.compat.v1.Event.FromString(record.numpy())
        for v in event.summary.value:
          if v.tag == tag:
            x = v.simple_value if v.HasField('simple_value') else tf.make_ndarray(v.tensor)
            values[event.step] = float(x)  # A later file (a resumed run) wins.
    except tf.errors.DataLossError:
      pass  # A file cut short by a preemption: keep what was read.
  return sorted(values.items())


def summarize(workdir, points, statuses=None):
  """Rows (dicts with COLUMNS) and the winner's name (None if no point has an accuracy)."""
  statuses = statuses or {}
  rows = []
  for name, _ in points:
    point_dir = join(workdir, name)
    accuracy = read_accuracy(point_dir)
    status = statuses.get(name) or _read_status(point_dir) or _status_of_files(point_dir, accuracy)
    rows.append({
        'point': name,
        'status': status,
        'final_accuracy': accuracy[-1][1] if accuracy else None,
        'best_accuracy': max(v for _, v in accuracy) if accuracy else None,
        'steps': accuracy[-1][0] if accuracy else None
    })
  candidates = [
      r for r in rows if r['final_accuracy'] is not None and r['status'] in ('ok', 'done')
  ]
  winner = max(candidates, key=lambda r: r['final_accuracy'])['point'] if candidates else None
  return rows, winner


def _csv_cell(value):
  if value is None:
    return ''
  return f'{value:.6g}' if isinstance(value, float) else value  # float32 values: 6 digits.


def _cell(value):
  if value is None:
    return '-'
  return f'{value:.4f}' if isinstance(value, float) else str(value)


def train_command(config, flags, workdir):
  """A vit-train command line to paste: `config`, the override `flags` and `workdir`."""
  return shlex.join(['vit-train', f'--config={config}', *flags, f'--workdir={workdir}'])


def markdown(rows, winner, config, points, sets, workdir):
  lines = [
      f'# Sweep of `{config}`', '', '| ' + ' | '.join(c.replace('_', ' ') for c in COLUMNS) + ' |',
      '|' + '---|' * len(COLUMNS)
  ]
  lines += ['| ' + ' | '.join(_cell(r[c]) for c in COLUMNS) + ' |' for r in rows]
  lines.append('')
  if winner:
    best = next(r for r in rows if r['point'] == winner)
    command = train_command(config, overrides(sets, dict(points)[winner]), join(workdir, 'winner'))
    lines.append(f'Winner (best final accuracy): **{winner}**, {best["final_accuracy"]:.4f}. '
                 f'Run it with: `{command}`')
    lines.append(selection_line(config, sets, dict(points)[winner], workdir))
  else:
    lines.append('Winner: none (no point has an accuracy yet).')
  return '\n'.join(lines) + '\n'


_DEV = ',dev'  # finetune:<model>,<dataset>,dev: Table 4's development splits
_SPLIT_FIELDS = ('train_split', 'eval_split')


def _split_names(spec):
  """The splits a TFDS split spec reads: 'train[:90%]+validation' -> {'train', 'validation'}."""
  return {part.split('[')[0].strip() for part in spec.split('+')}


def _is_finetune(config):
  """Whether --config names configs/finetune.py ('finetune:...' or a path to the file)."""
  path = config.partition(':')[0]
  return os.path.splitext(os.path.basename(path))[0] == 'finetune'


def _is_dev(config):
  return _is_finetune(config) and config.endswith(_DEV)


def held_out(config, point_config):
  """Whether a point's eval split is held out of its training data: a finetune ',dev' config
  (Table 4's and VTAB's development splits), or slices of the split it trains on
  ('train[:90%]' / 'train[90%:]'; that the two slices do not overlap is the user's part)."""
  train, evaluate = point_config.train_split, point_config.eval_split
  sliced = '[' in train and '[' in evaluate and train != evaluate
  return _is_dev(config) or (sliced and _split_names(evaluate) <= _split_names(train))


def selection_line(config, sets, assignments, workdir):
  """What the winner was chosen on, below the winner's line: held-out data, and then the
  command line of the final run on the whole training set (the paper's protocol: choose on
  held-out training data, train the winner on all of it, report on the test split); or the
  split the results are reported on, and how to hold data out instead."""
  (_, c), = point_configs(config, sets, [('winner', assignments)])
  on = f'Chosen on eval_split {c.eval_split!r}'
  if held_out(config, c):
    split_sets = [k for k, _ in sets if k in _SPLIT_FIELDS]
    if not (_is_dev(config) or split_sets):  # the config's own splits: no other run
      return f'{on}, held out of train_split {c.train_split!r}.'
    final = config[:-len(_DEV)] if _is_dev(config) else config
    flags = overrides([(k, v) for k, v in sets if k not in _SPLIT_FIELDS], assignments)
    return (f'{on}, held out of train_split {c.train_split!r}; train the winner on the whole '
            f'training set: `{train_command(final, flags, join(workdir, "final"))}`.')
  if _is_finetune(config):
    advice = f'sweep --config={config}{_DEV} (Table 4\'s development splits)'
  else:
    name = sorted(_split_names(c.train_split))[0]
    advice = (f"add --set 'config.train_split={name}[:90%]' --set "
              f"'config.eval_split={name}[90%:]'")
  return (f'Note: {on[0].lower()}{on[1:]}, not on data held out of train_split '
          f'{c.train_split!r} as the paper chooses: an accuracy reported on the split that chose '
          f'the winner overstates it. To choose on held-out data, {advice}.')


def write_summary(workdir, rows, winner, config, points, sets):
  """DIR/summary.md and DIR/summary.csv; returns the markdown."""
  text = markdown(rows, winner, config, points, sets, workdir)
  with paths.open_file(join(workdir, 'summary.md'), 'w') as f:
    f.write(text)
  buf = io.StringIO()
  writer = csv.DictWriter(buf, COLUMNS, lineterminator='\n')
  writer.writeheader()
  writer.writerows({c: _csv_cell(r[c]) for c in COLUMNS} for r in rows)
  with paths.open_file(join(workdir, 'summary.csv'), 'w') as f:
    f.write(buf.getvalue())
  return text


def write_record(workdir, config, grid, sets):
  """DIR/sweep.json: what the points run with, for --summarize-only."""
  path = join(workdir, RECORD)
  try:
    with paths.open_file(path, 'w') as f:
      json.dump({'config': config, 'grid': grid, 'sets': sets}, f, indent=1)
      f.write('\n')
  except Exception as e:  # pylint: disable=broad-except  (OSError, or gfile's for gs://)
    raise SweepError(f'cannot write {path}: {errors.one_line(e)}: choose a writable '
                     '--workdir') from None


def read_record(workdir):
  """(config, grid, sets) of DIR/sweep.json, as JSON has them (a tuple as a list); None
  where there is none (a sweep of a vit-sweep before it)."""
  path = join(workdir, RECORD)
  if not paths.exists(path):
    return None
  try:
    return _load_record(path)
  except Exception as e:  # pylint: disable=broad-except  (unreadable, not JSON, edited)
    raise SweepError(f'{path} cannot be read ({errors.one_line(e)}): delete it and pass the '
                     'sweep\'s --config, --sweep and --set flags with --summarize-only') from None


def _load_record(path):
  with paths.open_file(path, 'r') as f:
    record = json.load(f)
  return (record['config'], [(key, values) for key, values in record['grid']],
          [(key, value) for key, value in record['sets']])


def _same_config(recorded, given, given_config):
  """Whether --config `recorded` (of sweep.json) is `given` (loaded: `given_config`), by
  name or by what it loads ('quickstart' and 'configs/quickstart.py' are the same)."""
  if recorded == given:
    return True
  try:
    old = load_config(recorded)
  except SweepError:  # a config file since moved: not known to be the same
    return False
  return old.to_json_best_effort(sort_keys=True) == given_config.to_json_best_effort(sort_keys=True)


def _grid_as_run(grid):
  """The keys in order (they order the point names) and each key's values as its points'
  command lines write them: 1e-3 and 0.001 are the same, 1 and 1.0 are not."""
  return [(key, sorted({format_value(v) for v in values})) for key, values in grid]


def _sets_as_run(sets):
  """{key: value} of --set flags (the last of a key wins), '1e-3' and '0.001' the same."""
  return {key: _value(value) for key, value in sets}


def _as_flags(config, grid, sets):
  """The vit-sweep flags of a sweep.json, to paste."""

  def literal(value):
    return repr(value) if isinstance(value, str) else format_value(value)

  flags = ['--config', config]
  for key, values in grid:
    flags += ['--sweep', f'config.{key}=[{",".join(literal(v) for v in values)}]']
  for key, value in sets:
    flags += ['--set', f'config.{key}={value}']
  return shlex.join(flags)


def check_same_sweep(workdir, config_flag, config, grid, sets):
  """SweepError where `workdir` holds the sweep.json of a sweep with another --config, grid
  or --set flags: its points, summary and record would be mixed with this one's. The same
  flags (a sweep resumed) and a workdir without sweep.json (new, or of an older vit-sweep)
  go on."""
  path = join(workdir, RECORD)
  if not paths.exists(path):
    return
  try:
    record = _load_record(path)
  except Exception as e:  # pylint: disable=broad-except  (unreadable, not JSON, edited)
    raise SweepError(f'{path} cannot be read ({errors.one_line(e)}), so it cannot be told '
                     f'whether {workdir} holds another sweep: use another --workdir, or delete '
                     'it to run this sweep there') from None
  old_config, old_grid, old_sets = record
  differ = [
      flag for flag, same in (
          ('--config', _same_config(old_config, config_flag, config)),
          ('--sweep', _grid_as_run(old_grid) == _grid_as_run(grid)),
          ('--set', _sets_as_run(old_sets) == _sets_as_run(sets)),
      ) if not same
  ]
  if differ:
    raise SweepError(
        f'{workdir} holds another sweep, whose {", ".join(differ[:-1])}'
        f'{" and " * (len(differ) > 1)}{differ[-1]} {"differs" if len(differ) == 1 else "differ"} '
        f'({path}: '
        f'{_as_flags(old_config, old_grid, old_sets)}): use another --workdir, or give those '
        'flags to resume it (or --summarize-only to summarize it)')


def recorded_sweep(args):
  """(config, grid, sets) of the sweep in args.workdir: from its sweep.json, whatever flags
  --summarize-only has (a warning names those that differ); without one, from the flags."""
  if not paths.exists(args.workdir):
    raise SweepError(f'nothing to summarize in {args.workdir}: it does not exist; run without '
                     '--summarize-only first (or pass the --workdir of that run)')
  record = read_record(args.workdir)
  if record is None:
    if not args.config:
      raise SweepError(f'{args.workdir} has no {RECORD} (a sweep started by an older vit-sweep): '
                       'pass the --config, --sweep and --set flags it ran with')
    grid = build_grid(load_config(args.config), args.sweep)
    return args.config, grid, [parse_set(spec) for spec in args.sets]
  config, grid, sets = record
  given = {
      '--config': args.config,
      '--sweep': [parse_sweep(spec) for spec in args.sweep],
      '--set': [parse_set(spec) for spec in args.sets]
  }
  recorded = {'--config': config, '--sweep': grid, '--set': sets}
  as_json = lambda value: json.loads(json.dumps(value))  # tuples as lists, as recorded
  differ = [
      flag for flag in given if given[flag] and as_json(given[flag]) != as_json(recorded[flag])
  ]
  if differ:
    print(
        f'vit-sweep: warning: {" and ".join(differ)} ignored: the summary is of what the sweep '
        f'in {args.workdir} ran with ({join(args.workdir, RECORD)})', file=sys.stderr)
  return config, grid, sets


def _status_of_files(point_dir, accuracy):
  """A point without sweep_status (a TPU sweep's, or one the sweep's own Ctrl-C or SIGTERM
  stopped): 'done' once its final.npz is written, else 'not finished' where it started (its
  folder is there), which is no candidate for the winner (an accuracy part-way through its
  schedule)."""
  if paths.exists(join(point_dir, 'final.npz')):
    return 'done'
  return 'not finished' if accuracy or paths.exists(point_dir) else 'not run'


def _read_status(point_dir):
  path = join(point_dir, 'sweep_status')
  if '://' not in path and not os.path.exists(path):
    return None
  try:
    with paths.open_file(path, 'r') as f:
      return f.read().strip() or None
  except Exception:  # pylint: disable=broad-except  (missing remote file)
    return None


def _print_summary(workdir, rows, winner, config, points, sets, out):
  text = write_summary(workdir, rows, winner, config, points, sets)
  print(
      f'Summary (also in {join(workdir, "summary.md")} and {join(workdir, "summary.csv")}):\n'
      f'{text}', file=out)


def _exit_if_failed(workdir, num_points, failed):
  """Exit status 1 where points failed, naming the first one's log."""
  if failed:
    sys.exit(f'vit-sweep: {len(failed)} of {num_points} points failed (the summary lists them): '
             f'see {join(join(workdir, failed[0]), "sweep.log")}')


class _Parser(argparse.ArgumentParser):

  def error(self, message):
    raise SweepError(message)


def parser():
  p = _Parser(prog='vit-sweep', description=__doc__.split('\n')[0])
  p.register('action', None, cli_help.StoreOnce)  # a flag given twice is refused
  p.add_argument('--config', help='e.g. finetune:ViT-B_16,cifar10,dev (or a config file)')
  p.add_argument('--workdir', required=True, help='one sub-directory per point (may be gs://)')
  p.add_argument('--sweep', action='append', default=[],
                 help="'config.KEY=[v1,v2,...]'; several flags: the cartesian product")
  p.add_argument('--set', action='append', default=[], dest='sets',
                 help="'config.KEY=VALUE' for every point")
  p.add_argument('--tpu', help='run on this TPU VM (set up with launch.tpu_vm setup)')
  p.add_argument('--zone', help='the TPU VM zone (with --tpu)')
  p.add_argument('--project', help='Google Cloud project (with --tpu)')
  p.add_argument('--dry-run', '--dry_run', dest='dry_run', action='store_true',
                 help='print the commands, run nothing')
  p.add_argument(
      '--summarize-only', '--summarize_only', dest='summarize_only', action='store_true',
      help='only read the results and write the summary (of the sweep that '
      f'DIR/{RECORD} records: --workdir is enough)')
  return p


def main(argv=None, runner=run_local, out=None):
  """The CLI; `runner(argv, log_path) -> exit code` runs a local point (tests inject one)."""
  out = out or sys.stdout
  try:
    args, rest = parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if rest:
      key, sep, value = rest[0].partition('=')
      if key.startswith('--config.'):
        raise SweepError(f'unknown argument {rest[0]!r}: vit-sweep sets a config field for every '
                         f"point with --set '{key[2:]}={value if sep else 'VALUE'}' (and sweeps "
                         f"it with --sweep '{key[2:]}=[v1,v2,...]')")
      raise SweepError(f'unrecognized arguments: {" ".join(rest)}')
    given = [f for f, v in (('--zone', args.zone), ('--project', args.project)) if v]
    if given and not args.tpu:  # else the sweep would run on this machine instead
      raise SweepError(f'{" and ".join(given)} only with --tpu: add --tpu NAME to run on that TPU '
                       f'VM, or drop {"them" if len(given) > 1 else "it"} to run here')
    if args.tpu:  # vit-tpu's checks of the TPU VM's flags
      tpu_vm.check_name(args.tpu, '--tpu')
    if args.zone:
      args.zone = tpu_vm.zone_flag(args.zone)
    try:
      paths.resolve_run_folder(args.workdir, example='workdirs/sweep')
    except ValueError as e:
      raise SweepError(str(e)) from None
    if args.summarize_only:
      config, grid, sets = recorded_sweep(args)
      points = grid_points(grid)
      rows, winner = summarize(args.workdir, points)
      _print_summary(args.workdir, rows, winner, config, points, sets, out)
      _exit_if_failed(args.workdir, len(points),
                      [r['point'] for r in rows if r['status'].startswith('failed')])
      return
    if not args.config:
      raise SweepError('the following arguments are required: --config')
    if args.tpu and not args.zone:
      raise SweepError('--tpu needs --zone')
    config = load_config(args.config)
    grid = build_grid(config, args.sweep)
    points = grid_points(grid)
    sets = [parse_set(s) for s in args.sets]
    set_keys = [k for k, _ in sets]
    for key in set_keys:
      if set_keys.count(key) > 1:
        raise SweepError(f'config.{key} is given more than once in --set '
                         f'({", ".join(repr(v) for k, v in sets if k == key)}): give one')
    # A model.X the config does not list is checked against each point's variant, as
    # vit-train does it (configs.split_model_fields), when the points' configs are built.
    for key in [k for k, _ in sets] + [p[0] for p in points[0][1]]:
      if not key.startswith('model.'):
        try:  # vit-train's words: the nearest names, or the fields of a group given a value
          configs.check_override_names(config, [f'--config.{key}=...'])
        except ValueError as e:
          raise SweepError(str(e).replace('--config.', 'config.')) from None
    for flag in overrides(sets, [a for _, point in points for a in point]):
      key, _, text = flag[len('--config.'):].partition('=')
      if _has_field(config, key):
        check_value(config, key, text)
    swept = {k for k, _ in points[0][1]}
    if swept & {k for k, _ in sets}:
      raise SweepError(f'config.{sorted(swept & {k for k, _ in sets})[0]} is both --set and '
                       'swept: keep one')
    configs_of_points = point_configs(args.config, sets, points)
    preflight(configs_of_points, swept=swept)
    # A dry run shows what would run, so it is refused too; a gs:// one reads no bucket.
    if not (args.dry_run and paths.is_remote(args.workdir)):
      check_same_sweep(args.workdir, args.config, config, grid, sets)
    if not (args.tpu or args.dry_run):
      check_data(configs_of_points, swept=swept)
    check_workdir(args.workdir, create=not (args.tpu or args.dry_run))
    if not args.dry_run:
      write_record(args.workdir, args.config, grid, sets)
    statuses = None
    if args.tpu:
      tpu_args = argparse.Namespace(name=args.tpu, zone=args.zone, project=args.project)
      commands = tpu_commands(tpu_args, args.config, args.workdir, sets, points)
      tpu_vm.execute(commands, args.dry_run, out=out)
      if not args.dry_run:
        print(
            f'Started {len(points)} points on {args.tpu}. Follow one with '
            f'vit-tpu logs --name {args.tpu} --zone {args.zone} --log sweep-'
            f'{points[0][0]} -f; when all are done, add --summarize-only to this command.',
            file=out)
      return
    elif args.dry_run:
      for name, assignments in points:
        print(shlex.join(point_argv(args.config, args.workdir, sets, name, assignments)), file=out)
      return
    else:
      statuses = run_sweep(args.config, args.workdir, sets, points, runner, out)
    rows, winner = summarize(args.workdir, points, statuses)
    _print_summary(args.workdir, rows, winner, args.config, points, sets, out)
    _exit_if_failed(args.workdir, len(points),
                    [name for name, status in (statuses or {}).items() if status != 'ok'])
  except (SweepError, tpu_vm.LaunchError) as e:
    sys.exit(f'vit-sweep: error: {e}')
  except SweepInterrupted as e:
    ctrl_c.stop_with(f'vit-sweep: {e}', e.status)
  except KeyboardInterrupt:  # between points, or while checking or summarizing
    ctrl_c.interrupted('vit-sweep')


if __name__ == '__main__':
  console_scripts.run_as_main(main, 'vit-sweep')
