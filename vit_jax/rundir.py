"""What a run keeps in its workdir besides checkpoints: config.json, the check that a
resumed run has the config of the run it resumes, and the lock that keeps one run per
workdir."""
import contextlib
import json
import math
import os
import shlex
import socket
import threading
import time

from absl import logging
import jax
import ml_collections
import tensorflow as tf

from vit_jax import errors
from vit_jax import paths
from vit_jax import polyak

# Config fields that do not change what is trained: they may differ from the workdir's
# config.json when a run resumes. Every other field must match, unless it is named in
# config.resume_changes. (accum_steps: the same mean gradient; mesh_data, cpu_devices, fsdp,
# remat: the same step on another layout; both sum in another order, so the parameters
# agree to float rounding, not bit for bit. data_dir: the same data, moved.)
_FREE_FIELDS = ('log_every_steps', 'eval_every_steps', 'checkpoint_every_steps', 'keep_checkpoints',
                'prefetch', 'eval_batch_size', 'eval_split', 'mesh_data', 'cpu_devices', 'fsdp',
                'remat', 'accum_steps', 'data_dir', 'on_nonfinite', 'resume_changes', 'lr_grid',
                'pp.eval_crop', 'pp.central_crop_fraction', 'peak_flops_per_device')
_FREE_PREFIXES = ('fewshot_', 'profile_')

CPU_FLAGS_FILE = 'xla_cpu_flags.json'  # the XLA:CPU flags the run started with


def recorded_cpu_flags(workdir):
  """The XLA:CPU flags the run in `workdir` started with, or None for a new run (no
  checkpoint or final.npz yet, or no record)."""
  path = os.path.join(workdir, CPU_FLAGS_FILE)
  try:
    if not (tf.io.gfile.exists(path) and has_results(workdir)):
      return None
    with tf.io.gfile.GFile(path) as f:
      return tuple(json.load(f)['flags'])
  except (OSError, tf.errors.OpError, ValueError, KeyError, TypeError):
    return None  # unreadable: chosen afresh


def record_cpu_flags(workdir, flags):
  """Keeps `flags` (xla_cpu_flags.apply's choice; () when it was not called: XLA's
  defaults) for the runs that resume this one."""
  if jax.process_index() == 0:
    path = os.path.join(workdir, CPU_FLAGS_FILE)
    try:
      _write_whole(path, json.dumps({'flags': list(flags)}))
    except (OSError, tf.errors.OpError) as e:
      raise errors.ConfigError(f'cannot write {path}: {errors.write_failure(e, path)}, or use '
                               'another --workdir') from None


CLASS_NAMES_FILE = 'class_names.txt'  # the head's classes, one per line (vit-predict --labels)


def record_class_names(workdir, names):
  """Keeps the names of the classes the head is trained on, index i on line i: vit-predict
  and vit-evaluate then name and check classes without the training data (which may have
  moved, or gained a class folder since)."""
  if jax.process_index() == 0 and names:
    path = os.path.join(workdir, CLASS_NAMES_FILE)
    try:
      _write_whole(path, ''.join(f'{n}\n' for n in names))
    except (OSError, tf.errors.OpError) as e:
      raise errors.ConfigError(f'cannot write {path}: {errors.write_failure(e, path)}, or use '
                               'another --workdir') from None


def recorded_class_names(workdir):
  """The class names record_class_names kept for the run in `workdir`, or None (runs
  from before it, or without names)."""
  path = os.path.join(workdir, CLASS_NAMES_FILE)
  try:
    with tf.io.gfile.GFile(path) as f:
      return f.read().rstrip('\n').split('\n')
  except (tf.errors.NotFoundError, FileNotFoundError):
    return None
  except (UnicodeDecodeError, OSError, tf.errors.OpError) as e:
    reason = 'not UTF-8 text' if isinstance(e, UnicodeDecodeError) else errors.one_line(e)
    raise ValueError(f'{path} cannot be read ({reason}): restore it, or delete it (the classes '
                     'are then named from the run\'s dataset, where it is at hand)') from None


def _write_whole(path, text):
  """Writes `path` under a temporary name, then renames it: a crash or a full disk leaves
  the old file or the new one, never half of one (the resume check reads it)."""
  tmp = f'{path}.tmp-{os.getpid()}'
  try:
    with tf.io.gfile.GFile(tmp, 'w') as f:
      f.write(text)
    tf.io.gfile.rename(tmp, path, overwrite=True)
  finally:
    if tf.io.gfile.exists(tmp):
      tf.io.gfile.remove(tmp)


def write_config(config, workdir):
  if jax.process_index() == 0:
    path = os.path.join(workdir, 'config.json')
    try:
      _write_whole(path, config.to_json_best_effort(indent=2))
    except (OSError, tf.errors.OpError) as e:
      raise errors.ConfigError(f'cannot write {path}: {errors.write_failure(e, path)}, or use '
                               'another --workdir') from None


def recorded_config(workdir):
  """The config.json of the run in `workdir` as a ConfigDict, or None (missing, unreadable:
  check_resume_config says so where it matters)."""
  try:
    with tf.io.gfile.GFile(os.path.join(workdir, 'config.json')) as f:
      return ml_collections.ConfigDict(json.loads(f.read()))
  except (ValueError, TypeError, OSError, tf.errors.OpError):
    return None


def _flatten(tree, prefix=''):
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flatten(value, f'{prefix}{key}.'))
    else:
      out[prefix + key] = value
  return out


def has_results(workdir):
  """Whether `workdir` holds something a run with another config would spoil."""
  ckpt = os.path.join(workdir, 'checkpoints')
  steps = tf.io.gfile.isdir(ckpt) and any(
      d.rstrip('/').isdigit() for d in tf.io.gfile.listdir(ckpt))
  return steps or tf.io.gfile.exists(os.path.join(workdir, 'final.npz'))


def with_absolute_paths(config):
  """A copy of `config` whose local data and checkpoint paths are absolute, as config.json
  records them: it is read by vit-evaluate and vit-predict, and by resumed runs, from other
  directories."""
  config = config.copy_and_resolve_references()
  if str(config.dataset).startswith('folder:'):  # None (a config file's) is refused later
    # pylint: disable-next=g-import-not-at-top  (TFDS: not where vit-predict imports rundir)
    from vit_jax import data_sources
    data_sources.check_folder_named(config.dataset)  # '' would resolve to the current directory
    config.dataset = 'folder:' + paths.resolve(config.dataset[len('folder:'):])
  for name in ('data_dir', 'fewshot_data_dir', 'pretrained_path'):
    if config.get(name):
      config[name] = paths.resolve(config[name])
  return config


def check_resume_config(config, workdir):
  """Refuses (ConfigError) a config whose result-changing fields differ from the one of
  the run in `workdir`, unless config.resume_changes names them ('*': any)."""
  path = os.path.join(workdir, 'config.json')
  if not has_results(workdir):
    _refuse_a_config_json_of_another_program(path)
    return
  # The loop writes config.json before its first save, so results without it mean the file
  # was lost: resuming would check nothing and then record this config as the run's.
  unreadable = None if tf.io.gfile.exists(path) else 'is missing'
  if not unreadable:
    try:
      with tf.io.gfile.GFile(path) as f:
        old = _flatten(json.loads(f.read()))
    except (ValueError, OSError, tf.errors.OpError) as e:
      unreadable = f'cannot be read ({errors.one_line(e)})'
  allowed = [x.strip() for x in str(config.get('resume_changes', '')).split(',') if x.strip()]
  new = _flatten(json.loads(config.to_json_best_effort()))
  if not unreadable:
    _check_polyak_kept(old, new, workdir)

  def free(key):
    return (key in _FREE_FIELDS or key.startswith(_FREE_PREFIXES)
            or any(key == a or key.startswith(a + '.') for a in allowed))

  # Fields the record lacks (written by an earlier vit_jax, or edited), result-changing first.
  lacking = [] if unreadable else sorted(set(new) - set(old), key=lambda k: (free(k), k))
  if '*' in allowed:
    # A finished run started again writes nothing: without this a lost or damaged file, or
    # one that lacks fields, stays so.
    if unreadable or lacking:
      why = unreadable or f'has no field {lacking[0]!r} (and {len(lacking) - 1} more)'
      logging.warning(
          '%s %s: written again from this config, which resume_changes=\'*\' '
          'accepts as the run\'s', path, why)
      write_config(config, workdir)
    return
  if unreadable:
    raise errors.ConfigError(
        f'{path} {unreadable}, so this config cannot be checked against the run\'s: restore '
        'the file, or pass --config.resume_changes=\'*\' to resume with this config') from None
  # A mistyped name would let nothing through and then be named in the refusal's own fix.
  unknown = [a for a in allowed if not any(k == a or k.startswith(a + '.') for k in {*old, *new})]
  if unknown:
    raise errors.ConfigError(f'resume_changes names {unknown[0]!r}, which is no config field: '
                             'set --config.resume_changes to fields of the config (e.g. '
                             "base_lr,total_steps), or '*' for any")

  if lacking:  # what the run used for them is not known
    shown = ', '.join(f'{k}={_flag_value(new[k])}' for k in lacking[:4])
    more = f' and {len(lacking) - 4} more' if len(lacking) > 4 else ''
    logging.warning(
        '%s lacks %s (written by another version of vit_jax, or edited): the run goes on '
        'with this config\'s values for them (%s%s), which config.json records from its next '
        'save', path, errors.count_of(len(lacking), 'field'), shown, more)

  changed = [k for k in sorted(old) if k in new and old[k] != new[k] and not free(k)]
  if changed:
    shown = ', '.join(f'{k} {old[k]!r} -> {new[k]!r}' for k in changed[:4])
    more = f' and {len(changed) - 4} more' if len(changed) > 4 else ''
    # The run's own values first: a config's defaults change between versions of vit_jax
    # (the quickstart's patches went from 4 to 7), and a field that shapes the parameters
    # cannot be changed by a resume at all.
    back = ' '.join(f'--config.{k}={_flag_value(old[k])}' for k in changed)
    shaping = [k for k in changed if _shapes_parameters(k)]
    if shaping:
      change = (f'{", ".join(shaping)} shape{"s" if len(shaping) == 1 else ""} the parameters, '
                'which a resume cannot change')
    else:
      change = (f'to change {"it" if len(changed) == 1 else "them"}, pass '
                f'--config.resume_changes={",".join([*allowed, *changed])}')
    raise errors.ConfigError(
        f'workdir {workdir} holds a run with another config ({shown}{more}): to go on with '
        f'that run, pass its value{"s" if len(changed) > 1 else ""} ({back}); {change}; or use '
        'another --workdir')


# Fields every config.json a vit_jax run wrote holds, in every version.
_FIELDS_OF_OURS = ('model_name', 'dataset', 'batch_size')


def _refuse_a_config_json_of_another_program(path):
  """A new run saves its config as `path`: a config.json that is not a vit_jax run's (a
  user's own file, in a workdir such as `.`) had been overwritten without a word."""
  if not tf.io.gfile.exists(path):
    return
  try:
    with tf.io.gfile.GFile(path) as f:
      record = json.loads(f.read())
    ours = isinstance(record, dict) and all(k in record for k in _FIELDS_OF_OURS)
  except (ValueError, OSError, tf.errors.OpError):
    ours = False  # unreadable: not a file a run wrote whole (they are written atomically)
  if not ours:
    raise errors.ConfigError(f'{path} is not the config of a vit_jax run, and a run records its '
                             'own there: use another --workdir, or move that file out of it')


def _flag_value(value):
  """A config.json value as a --config.x= flag's value in a shell."""
  if isinstance(value, list):  # a tuple in the config
    value = tuple(value)
  return value if isinstance(value, (bool, int, float)) else shlex.quote(str(value))


def _shapes_parameters(field):
  """Whether a config field decides the shape of some parameter (the model's own fields
  other than its dropout rates, the model, the head's classes)."""
  if field.startswith('model.'):
    return not field.endswith('dropout_rate')
  return field in ('model_name', 'num_classes')


def _check_polyak_kept(old, new, workdir):
  """Refuses turning Polyak averaging on or off on resume, whatever resume_changes says: its
  running sums are part of the checkpoints (or are not), so the saved state would not fit
  (it had been refused as 'checkpoints of another model', naming no field)."""
  before, after = old.get('polyak_decay', 0.0), new.get('polyak_decay', 0.0)
  if polyak.enabled(old) != polyak.enabled(new):
    raise errors.ConfigError(
        f'workdir {workdir} holds a run with polyak_decay {before!r}: {after!r} would turn '
        f'Polyak averaging {"on" if after > 0 else "off"}, which a resume cannot (the '
        f'checkpoints hold its sums, or none): keep --config.polyak_decay={before!r}, use '
        'another --workdir, or fine-tune from that run with '
        f'--config.pretrained_path={shlex.quote(os.path.join(workdir, "final.npz"))}')


def _proc_stat(pid):
  """The fields of /proc/<pid>/stat after the command's name (state first), or []."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()
  except (OSError, IndexError):
    return []


def _proc_start(pid):
  """The start time of process `pid` in clock ticks (tells a reused pid apart), or None."""
  try:
    return int(_proc_stat(pid)[19])
  except (ValueError, IndexError):
    return None


def _ended(pid):
  """Whether process `pid` has ended but is not yet reaped (a zombie): kill(pid, 0) still
  finds it, and its lock had kept the same command out until its parent waited for it."""
  return _proc_stat(pid)[:1] == ['Z']


def leave_at_once(workdir, line):
  """For a process about to os._exit (a second Ctrl-C): appends `line` (bytes) to
  train.INFO, as the run's other stops end it, and removes the lock if it is this
  process's. Local workdirs only, and os calls only: this runs in a signal handler."""
  if paths.is_remote(workdir):
    return
  try:
    fd = os.open(os.path.join(workdir, 'train.INFO'), os.O_WRONLY | os.O_APPEND)
    try:
      os.write(fd, line)
    finally:
      os.close(fd)
  except OSError:
    pass
  lock = os.path.join(workdir, 'lock')
  try:
    with open(lock, encoding='utf-8') as f:
      holder = json.loads(f.read())
    if (holder.get('host'), holder.get('pid')) == (socket.gethostname(), os.getpid()):
      os.unlink(lock)
  except (OSError, ValueError, AttributeError):
    pass


# A lock's pid tells nothing on another host (a shared folder; a Colab runtime gone, whose
# successor has another host name): its run touches it every HEARTBEAT_S, and one left
# untouched for GONE_AFTER_S is stale.
HEARTBEAT_S = 60
GONE_AFTER_S = 600


class WorkdirLock:
  """One run per workdir: `<workdir>/lock` holds the host, pid and start time of its run.

  Local workdirs: created with O_CREAT|O_EXCL; a lock whose process is gone (same host,
  pid not running, or running but started at another time; another host: not touched for
  GONE_AFTER_S) is stale and taken over with a warning. gs:// (no exclusive create on
  object stores): the lock object is written and a holder found there is only warned
  about, since a preempted TPU VM cannot remove its lock and must resume. Only process 0
  locks.
  """

  def __init__(self, workdir, process_index=None):
    """process_index: the caller's among JAX's processes (None: jax.process_index()); a
    command that runs others (vit-sweep), one process without JAX, passes 0."""
    self.path = os.path.join(workdir, 'lock')
    self.held = False
    self._process_index = process_index
    self._stop_touching = threading.Event()
    self.took_over = None  # the holder of a stale lock acquire removed, if it did

  def _info(self):
    return {
        'host': socket.gethostname(),
        'pid': os.getpid(),
        'proc_start': _proc_start(os.getpid()),
        'started': time.strftime('%Y-%m-%d %H:%M:%S %Z')
    }

  def _read(self):
    try:
      with tf.io.gfile.GFile(self.path) as f:
        return json.loads(f.read())
    except (ValueError, OSError, tf.errors.OpError):
      return None

  def _stale(self, holder):
    if holder is None:  # unreadable: stale unless being written right now
      try:
        return time.time() - os.path.getmtime(self.path) > 10
      except OSError:
        return True
    if holder.get('host') != socket.gethostname():
      return self._untouched_s() > GONE_AFTER_S
    pid = int(holder.get('pid', -1))
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return True
    except PermissionError:
      pass
    if _ended(pid):
      return True
    start = holder.get('proc_start')
    return start is not None and _proc_start(pid) not in (None, start)

  def _untouched_s(self):
    try:
      return time.time() - os.path.getmtime(self.path)
    except OSError:  # gone: the next exclusive create tells
      return 0

  def _touch_while_held(self):
    """Touches the lock every HEARTBEAT_S until released, from a daemon thread: a run on
    another host tells by its age whether this one is still there."""
    stop = self._stop_touching = threading.Event()

    def touch():
      while not stop.wait(HEARTBEAT_S):
        with contextlib.suppress(OSError):  # gone: lost() tells the run at its next save
          os.utime(self.path)

    threading.Thread(target=touch, name='workdir-lock', daemon=True).start()

  def _holder_text(self, holder):
    if holder is None:
      return f'an unreadable lock {self.path}'
    return (f'pid {holder.get("pid")} on {holder.get("host")} (started '
            f'{holder.get("started")}, lock {self.path})')

  def acquire(self):
    if (jax.process_index() if self._process_index is None else self._process_index) != 0:
      return
    data = json.dumps(self._info())
    try:
      if paths.is_remote(self.path):
        if tf.io.gfile.exists(self.path):
          logging.warning(
              'The workdir may be in use by %s; object stores cannot lock: make '
              'sure no other run uses it', self._holder_text(self._read()))
        with tf.io.gfile.GFile(self.path, 'w') as f:
          f.write(data)
        self.held = True
        return
      for _ in range(50):
        try:
          fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
          holder = self._read()
          if not self._stale(holder):
            raise errors.ConfigError(
                f'workdir {os.path.dirname(self.path)} is in use by {self._holder_text(holder)}: '
                f'wait for that run to end or use another --workdir{self._when_taken_over(holder)}'
            ) from None
          self._remove_stale()
          continue
        try:
          with os.fdopen(fd, 'w') as f:
            f.write(data)
        except OSError:
          # Left empty (a full disk), it would keep the same command out for 10 s as an
          # unreadable lock that is being written.
          with contextlib.suppress(OSError):
            os.remove(self.path)
          raise
        self.held = True
        self._touch_while_held()
        return
      raise errors.ConfigError(f'cannot take the lock {self.path}: another run keeps taking it')
    except (OSError, tf.errors.OpError) as e:
      self.release()
      workdir = os.path.dirname(self.path)
      raise errors.ConfigError(
          f'cannot write to workdir {workdir}: '
          f'{errors.write_failure(e, workdir)}, or use another --workdir') from None

  def _when_taken_over(self, holder):
    if holder is None or holder.get('host') == socket.gethostname():
      return ' (delete the lock file only if that run is gone)'
    minutes = max(1, math.ceil((GONE_AFTER_S - self._untouched_s()) / 60))
    return (f' (that run touches the lock every {HEARTBEAT_S} s: the same command takes it over '
            f'once it is left untouched for {GONE_AFTER_S // 60} minutes, in {minutes} at the '
            'earliest)')

  def _remove_stale(self):
    """Removes a stale lock while holding `<lock>.takeover` (made exclusively): of two runs
    that found the lock stale at once, one had removed the lock the other had just taken,
    and both ran. The lock is checked again inside, so a fresh one is never removed."""
    guard = self.path + '.takeover'
    try:
      os.close(os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:  # another run is taking over: look again shortly
      try:
        if time.time() - os.path.getmtime(guard) > 10:  # its taker died in the act
          os.unlink(guard)
      except FileNotFoundError:
        pass
      time.sleep(0.05)
      return
    try:
      holder = self._read()
      if os.path.exists(self.path) and self._stale(holder):
        if holder is None:
          logging.warning(
              'Taking over the lock %s, unreadable and over 10 s old: the run '
              'that wrote it is gone', self.path)
        elif holder.get('host') != socket.gethostname():
          logging.warning(
              'Taking over the lock of %s: untouched for %d minutes (its run touches it every '
              '%d s), that run is gone', self._holder_text(holder),
              self._untouched_s() // 60, HEARTBEAT_S)
        else:
          logging.warning(
              'Taking over the stale lock of %s: that process ended without removing it (killed '
              'outright: kill -9, or the kernel\'s out-of-memory killer, which `dmesg | grep -i '
              'killed` tells; or a crash)', self._holder_text(holder))
        os.unlink(self.path)
        self.took_over = holder or {}
    finally:
      os.unlink(guard)

  def training_now(self, this_host_only=False):
    """'pid N on HOST (started ..., lock ...)' where a live run (on this host only, if
    `this_host_only`) holds the lock, else None (also on gs://, where a preempted run's lock
    stays and cannot be told stale)."""
    if paths.is_remote(self.path) or not os.path.exists(self.path):
      return None
    holder = self._read()
    if this_host_only and (holder or {}).get('host') != socket.gethostname():
      return None
    return None if self._stale(holder) else self._holder_text(holder)

  def lost(self):
    """None while the lock is this run's (or not held: other processes, gs://, whose
    lock a preempted run's successor takes over); else what became of it, for a run that
    must stop rather than write beside another."""
    if not self.held or paths.is_remote(self.path):
      return None
    holder = self._read()
    if holder is None and not os.path.exists(self.path):
      return f'its lock {self.path} is gone (the workdir or the lock deleted?)'
    if holder is None or (holder.get('host'), holder.get('pid')) != (socket.gethostname(),
                                                                     os.getpid()):
      return f'its lock is now held by {self._holder_text(holder)}'
    return None

  def release(self):
    """Removes the lock if it is still this run's (a run that took it over keeps its own)."""
    self._stop_touching.set()
    if self.held:
      self.held = False
      holder = self._read() or {}
      if (holder.get('host'), holder.get('pid')) != (socket.gethostname(), os.getpid()):
        return
      try:
        tf.io.gfile.remove(self.path)
      except (OSError, tf.errors.OpError):
        pass
