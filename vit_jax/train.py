"""One training loop for pre-training (Table 3) and fine-tuning (Table 4).

The two differ in config only. The step is jitted over a 1-D device mesh with explicit
shardings (data parallel, or FSDP with `config.fsdp`); batches arrive as global
jax.Arrays. The state is {'step', 'params', 'opt_state'}; everything random in step s
(data order, augmentation, dropout) is a function of (seed, s), so a run resumed from
its orbax checkpoint continues exactly where it stopped.
"""
import collections
import contextlib
import logging as std_logging
import math
import os
import shlex
import signal
import sys
import threading
import time
import traceback

from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import tensorflow as tf

from vit_jax import checkpoint
from vit_jax import chrono as chrono_lib
from vit_jax import config_checks
from vit_jax import ctrl_c
from vit_jax import data_sources
from vit_jax import device_peaks
from vit_jax import errors
from vit_jax import evaluate as evaluate_lib
from vit_jax import flops
from vit_jax import host_memory
from vit_jax import input_pipeline
from vit_jax import masked_patches
from vit_jax import models
from vit_jax import optim
from vit_jax import paths
from vit_jax import polyak
from vit_jax import rundir
from vit_jax import sharding
from vit_jax import tensorboard_events
from vit_jax import trace
from vit_jax import step as step_lib
from vit_jax import xla_cpu_flags
from vit_jax.configs import finetune
from vit_jax.models import remat as remat_lib

ConfigError = errors.ConfigError  # raised by train_and_evaluate; main prints it as one line
TrainingError = errors.TrainingError

build_model = models.from_config  # (config, num_classes) -> the flax module
make_eval_step = evaluate_lib.top1_step  # (model) -> the top-1 step the loop jits


def evaluate(eval_step, params, config, batch_sharding, num_classes=None):
  """(top-1 accuracy, examples counted, undecodable images left out) over the whole
  evaluation split, as the CLI counts them (evaluate.accuracy_over_split), with the labels
  checked against the head."""
  check = None if num_classes is None else (
      lambda labels: _check_labels(labels, num_classes, 'eval_split', config.eval_split))
  return evaluate_lib.accuracy_over_split(eval_step, params, config, batch_sharding, check)


def _real_config(config, num_classes):
  """The ImageNet ReaL evaluation config when config.eval_real, else None."""
  if not config.get('eval_real', False):
    return None
  real = evaluate_lib.real_config(config)
  try:
    classes = input_pipeline.get_info(real).num_classes
  except data_sources.NotPrepared as e:  # not --config.data_dir: the run's own data is there
    raise e.said_of('eval_real', 'set --config.eval_real=False') from None
  if num_classes != classes:
    raise ConfigError(f'eval_real scores a head of the {classes} ImageNet classes, but this one '
                      f'has {num_classes}: set --config.eval_real=False')
  return real


def _evaluate_real(eval_step, params, real, batch_sharding, step, writer):
  accuracy, n, _ = evaluate(eval_step, params, real, batch_sharding)
  logging.info('step %d  ImageNet ReaL top-1 accuracy %.4f (%d images with a ReaL label)', step,
               accuracy, n)
  writer.write_scalars(step, {'real_accuracy': accuracy})
  return {'real_accuracy': accuracy, 'real_examples': n}


def _check_labels(labels, num_classes, field, split):
  if labels.ndim > 1:  # multi-hot: its size is the dataset's classes, checked at start-up
    return
  if labels.size and (labels.max() >= num_classes or labels.min() < 0):
    bad = int(labels.max() if labels.max() >= num_classes else labels.min())
    raise TrainingError(f'{field} {split!r} has label {bad}, outside the head\'s {num_classes} '
                        f'classes [0, {num_classes - 1}]: set --config.num_classes to at least '
                        f'{bad + 1} (or -1 to take it from the dataset), or fix the labels')


def _checked_labels(batches, num_classes, split):
  """The training batches, each checked on the host: a label >= num_classes stops the run
  (jax.nn.one_hot would make it an all-zero target, silently)."""
  for batch in batches:
    _check_labels(batch['label'], num_classes, 'train_split', split)
    yield batch


def _local(tree):
  """Host values of replicated arrays (on several hosts they are not fully addressable)."""
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def _check_resumed_classes(config, workdir, num_classes):
  """The head's class i is the dataset's label i: a resumed run whose dataset now names its
  classes otherwise (a class folder renamed: labels from the sorted names shift) is refused,
  before its first step overwrites class_names.txt with the new order."""
  recorded = rundir.recorded_class_names(workdir)
  if recorded is None or masked_patches.is_masked(config):
    return
  names = list(input_pipeline.class_names(config))
  if not len(names) == len(recorded) == num_classes or names == recorded:
    return  # (another number of classes: the head's shape does not fit the checkpoint's)
  i = next(i for i, (a, b) in enumerate(zip(recorded, names)) if a != b)
  raise ConfigError(f'{config.dataset} names its class {i} {names[i]!r} where the run in '
                    f'{workdir} trained {recorded[i]!r} ({rundir.CLASS_NAMES_FILE}): its labels '
                    'would no longer be the head\'s; give the classes their names back, or use '
                    'another --workdir for this data')


def train_and_evaluate(config, workdir, *, stop_after_steps=None, writer=None, on_start=None):
  """Trains `config` in `workdir`, resuming from its latest checkpoint; returns metrics.

  `stop_after_steps` ends the run early at that step (with a checkpoint), as a
  preemption would, without changing the schedule. A local `workdir` may be relative.
  `writer`: where the scalars and hyperparameters go (anything with write_scalars,
  write_hparams and flush, a clu metric writer too; default: a TensorBoard event file in
  `workdir`). `on_start()` is called once the workdir is this run's (locked, its
  config checked), before anything is written there (vit-train opens its log file).
  Faults end the run with a one-line ConfigError (TrainingError while training):
  a non-finite loss, gradient or update (nothing non-finite is ever saved), a failed
  checkpoint write, a config that differs from the workdir's run, a workdir in use by
  another run, checkpoints of another model. SIGTERM, Ctrl-C or a closed terminal during
  the steps end it with StoppedBySignal once a checkpoint is saved. SIGTERM outside the
  training steps (set-up, restore, compile, wrap-up) raises PreemptedOutsideTheLoop,
  SIGHUP there TerminalClosedOutsideTheLoop.
  """
  with _signals_outside_the_loop():
    return _set_up_and_train(config, workdir, stop_after_steps, writer, on_start)


class PreemptedOutsideTheLoop(BaseException):
  """SIGTERM (a preempted TPU VM) while the training loop did not hold the signal: data
  set-up, restore and compile (minutes on a large model) or the wrap-up. A BaseException,
  so that no library's `except Exception` swallows it; the workdir's lock is released as
  it passes."""


class TerminalClosedOutsideTheLoop(BaseException):
  """SIGHUP (the terminal closed) where PreemptedOutsideTheLoop would be raised. It had
  killed the run there (status 129, no line in train.INFO, the lock left behind); a run
  started under nohup ignores it."""


_OUTSIDE_THE_LOOP = {
    signal.SIGTERM: PreemptedOutsideTheLoop,
    signal.SIGHUP: TerminalClosedOutsideTheLoop
}
# The signals received outside the loop. The handler's exception is lost where the signal
# lands in a garbage-collection callback or a __del__ (Python prints "Exception ignored"
# and goes on): the loop checks this before its first step.
_RECEIVED_OUTSIDE_THE_LOOP = []


@contextlib.contextmanager
def _signals_outside_the_loop():
  """One process: SIGTERM and SIGHUP raise their _OUTSIDE_THE_LOOP exception until
  _Preemption takes them over (and again once it gives them back). Several: JAX's
  preemption sync manager has SIGTERM, and SIGHUP keeps Python's default."""
  if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
    yield
    return

  def raise_outside_the_loop(signum, frame):
    del frame
    # A second one (a sweep passes on the SIGTERM its process group also got) would land
    # in the unwinding of the first: the lock's release, the line.
    signal.signal(signum, signal.SIG_IGN)
    _RECEIVED_OUTSIDE_THE_LOOP.append(signum)
    raise _OUTSIDE_THE_LOOP[signum]()

  _RECEIVED_OUTSIDE_THE_LOOP.clear()
  with ctrl_c.handling(_OUTSIDE_THE_LOOP, raise_outside_the_loop):  # nohup's SIGHUP: ignored
    yield


def _set_up_and_train(config, workdir, stop_after_steps, writer, on_start):
  try:
    workdir = paths.resolve_run_folder(workdir)  # orbax refuses relative checkpoint paths
    config = rundir.with_absolute_paths(config)
    # What needs no dataset first: a mistyped model is not reported as data that is missing.
    config_checks.validate_config(config)
    # Local files only: a gs:// one is asked after the data's checks, as asking a bucket
    # here would stall an offline run before its data is checked.
    local = config.pretrained_path and not paths.is_remote(config.pretrained_path)
    if local and not os.path.exists(config.pretrained_path):
      raise ValueError(f'pretrained_path {config.pretrained_path} does not exist: set '
                       '--config.pretrained_path to a checkpoint .npz (a published file or a '
                       "run's final.npz), or '' to start from scratch")
    info = input_pipeline.get_info(config)
    data_summary = input_pipeline.validate_splits(config)
    turned_photos = input_pipeline.orientation_warning(config)
    num_classes = config.num_classes if config.num_classes > 0 else info.num_classes
    config_checks.validate_config(config, info.num_train_examples, dataset_classes=info.num_classes)
    total_steps = optim.total_steps(config, info.num_train_examples)
    size_note = _train_size_note(config, total_steps)
    schedule = optim.learning_rate_schedule(config, total_steps)
    tx = optim.make_optimizer(config, total_steps)
    # The masked-patch objective predicts patches, not classes: no classification head.
    model = build_model(config, 0 if masked_patches.is_masked(config) else num_classes)
    # The evaluations' other data too: a dataset not prepared is refused before the workdir.
    real = _real_config(config, num_classes)
    fewshot = _fewshot_evaluator(config, model)
    if paths.is_remote(config.pretrained_path or ''):  # before the workdir is made
      checkpoint.check_reachable(config.pretrained_path)
  except checkpoint.UnreadableFileError as e:
    raise _unreadable_pretrained(config, e) from None
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(str(e)) from None
  try:
    paths.make_workdir(workdir)  # local or gs://
  except ValueError as e:
    raise ConfigError(str(e)) from None
  lock = rundir.WorkdirLock(workdir)
  lock.acquire()
  try:
    rundir.check_resume_config(config, workdir)
    if on_start:
      on_start()
    for line in [data_summary] + (fewshot.descriptions() if fewshot else []):
      if line:
        logging.info('%s', line)
    for warning in (turned_photos, size_note):
      if warning:
        logging.warning('%s', warning)
    return _train(config, workdir, info, num_classes, total_steps, schedule, tx, model, real,
                  fewshot, stop_after_steps, writer, lock)
  finally:
    lock.release()


def _unreadable_pretrained(config, error):
  local = ' as --config.pretrained_path=FILE' if str(error).endswith('the local file') else ''
  note = finetune.unpublished_note(config.model_name, config.pretrained_path)
  return ConfigError(f'pretrained_path {error}{local}{note}')


def _train_size_note(config, total_steps):
  """A warning where config.num_train_examples is given (Table 3's configs give their
  dataset's) and the train split holds another number: with another dataset swapped in, the
  epochs, and a total_steps derived from num_epochs, would count the config's number."""
  if config.num_train_examples is None or config.num_train_examples <= 0:
    return None
  held = input_pipeline.count_split(config, 'train_split')
  if held == config.num_train_examples:
    return None
  steps = f', and total_steps {total_steps} from num_epochs' if config.total_steps <= 0 else ''
  return (f'num_train_examples {config.num_train_examples} is the config\'s, but train_split '
          f'{config.train_split!r} of {config.dataset} holds {held}: epochs count the config\'s'
          f'{steps}; set --config.num_train_examples=-1 to count the split')


def _fewshot_evaluator(config, model):
  """The loop's FewShotEvaluator, or None. Made before the workdir, as it reads the k-shot
  pools: a class with fewer images than the shots is refused at start-up, not once the
  step has compiled (minutes on a large model)."""
  if not config.fewshot_every_steps:
    return None
  evaluate_lib.check_fewshot_data(config)
  try:
    return evaluate_lib.FewShotEvaluator(config, model)
  except ValueError as e:
    raise ValueError(f'few-shot evaluation: {e} (--config.fewshot_datasets, '
                     '--config.fewshot_shots)') from None


# on_nonfinite=skip stops a run whose updates are skipped this many steps in a row, or half
# its schedule's steps where that is fewer: its parameters no longer change, and the steps
# left would only spend time (a short run would end with exit 0 and untrained parameters).
SKIPPED_IN_A_ROW_LIMIT = 100


def _skipped_in_a_row_limit(total_steps):
  return max(1, min(SKIPPED_IN_A_ROW_LIMIT, total_steps // 2))


def _guard_message(guard, config, last_saved):
  """The one line that stops a diverged run: with on_nonfinite=stop at its first non-finite
  step, with skip once _skipped_in_a_row_limit steps in a row were skipped."""
  kept = (f'the checkpoint of step {last_saved} is kept'
          if last_saved else 'no checkpoint was written')
  fixes = [f'a lower --config.base_lr (now {config.base_lr:g})']
  if not config.grad_clip_norm:
    fixes.append('--config.grad_clip_norm=1')
  fixes.append(f'a longer --config.warmup_steps (now {config.warmup_steps})')
  shrink = config.weight_decay * config.base_lr  # the kernels' decay per step at the peak
  # At >= 1 each step flips and grows the kernels, whatever the gradient; named where the
  # decay itself is out of range (decoupled decay is a fraction: the paper's is 0.1).
  if shrink >= 1 and config.weight_decay > 1:
    fixes.append(f'a lower --config.weight_decay (now {config.weight_decay:g}: times base_lr '
                 f'{shrink:g}, which must stay well below 1)')
  if config.dtype != 'float32':
    fixes.append('--config.dtype=float32')
  if config.get('on_nonfinite', 'stop') == 'stop':
    what = (f'loss {float(guard["loss"]):g}, gradient norm {float(guard["grad_norm"]):g}, update '
            f'norm {float(guard["update_norm"]):g} at step {int(guard["first_bad"])}: training '
            'diverged')
  else:
    last, n = int(guard['last_skipped']), int(guard['skipped_in_a_row'])
    what = (f'steps {last - n + 1}-{last} all had a non-finite loss, gradient or update and '
            'were skipped (on_nonfinite=skip): training makes no progress')
  return f'{what}, so it stopped ({kept}); try {", ".join(fixes)}'


def _then_run_again(last_saved):
  """How a failed save's line ends: what the same command does next."""
  if last_saved:
    return f', then run the same command to resume from step {last_saved}'
  return ', then run the same command to start again (this run saved no checkpoint)'


class _ShortLibraryErrors(std_logging.Filter):
  """orbax logs a failed background write with its whole traceback, several times over;
  the loop reports the failure itself in one line, so orbax's records keep their message
  and lose the traceback."""

  def filter(self, record):
    if record.exc_info and '/orbax/' in record.pathname:
      record.exc_info, record.exc_text = None, None
    return True


class _DropOrphanedWriteTasks(std_logging.Filter):
  """asyncio logs each failed orbax write task or future it garbage-collects ('Task/Future
  exception was never retrieved'), possibly after the loop's one-line report, as the
  process ends; the failure is already reported, so these records are dropped. They are
  known by orbax in their traceback, or, for a bare future (no traceback), by the error
  naming orbax's temporary checkpoint directory."""

  def filter(self, record):
    if 'exception was never retrieved' not in record.getMessage():
      return True
    tb = record.exc_info[2] if record.exc_info else None
    files = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(tb)]
    return not any(
        '/orbax/' in f or '.orbax-checkpoint-tmp' in f for f in [record.getMessage(), *files])


def _closed_loop(value):
  return type(value) is RuntimeError and str(value) == 'Event loop is closed'


def _orbax_coroutine(obj):
  """An orbax coroutine dropped with its error unread: when a restore fails on one array,
  the reads of the others fail too and are never awaited (a damaged checkpoint printed
  hundreds of their tracebacks; checkpoint.restore_train_state reports it in one line)."""
  code = getattr(obj, 'cr_code', None)
  return code is not None and '/orbax/' in code.co_filename


def _quiet_closed_loop(excepthook, unraisablehook):
  """sys.excepthook and sys.unraisablehook without the 'Event loop is closed' tracebacks
  that tensorstore's callbacks print once orbax has closed the event loop of a failed
  write, nor those of orbax's unread coroutines (the loop reports the failure itself, in
  one line)."""

  def on_exception(kind, value, tb):
    if not _closed_loop(value):
      excepthook(kind, value, tb)

  def on_unraisable(unraisable):
    if not (_closed_loop(unraisable.exc_value) or _orbax_coroutine(unraisable.object)):
      unraisablehook(unraisable)

  on_exception.quiet_closed_loop = on_unraisable.quiet_closed_loop = True
  return on_exception, on_unraisable


def _quiet_library_noise():
  absl_logger = std_logging.getLogger('absl')
  if not any(isinstance(f, _ShortLibraryErrors) for f in absl_logger.filters):
    absl_logger.addFilter(_ShortLibraryErrors())
  asyncio_logger = std_logging.getLogger('asyncio')
  if not any(isinstance(f, _DropOrphanedWriteTasks) for f in asyncio_logger.filters):
    asyncio_logger.addFilter(_DropOrphanedWriteTasks())
  if not getattr(sys.excepthook, 'quiet_closed_loop', False):
    sys.excepthook, sys.unraisablehook = _quiet_closed_loop(sys.excepthook, sys.unraisablehook)


def _train(config, workdir, info, num_classes, total_steps, schedule, tx, model, real, fewshot,
           stop_after_steps, writer, lock):
  _quiet_library_noise()
  mesh = sharding.make_mesh(config)
  if mesh.size < jax.device_count():
    logging.info('mesh_data %d: the run uses %d of the %d devices (%d idle)', config.mesh_data,
                 mesh.size, jax.device_count(),
                 jax.device_count() - mesh.size)
  batch_sharding = sharding.data_sharding(mesh)
  replicated = sharding.replicated(mesh)
  ckpt_dir = os.path.join(workdir, 'checkpoints')
  try:
    manager = checkpoint.train_state_manager(ckpt_dir, config.keep_checkpoints)
  except (OSError, tf.errors.OpError) as e:
    raise ConfigError(f'cannot write to {ckpt_dir}: {errors.write_failure(e, ckpt_dir)}, or use '
                      'another --workdir') from None
  try:
    state, state_sh = step_lib.create_train_state(config, model, tx, mesh, num_classes, manager)
  except checkpoint.DifferentModelError as e:
    final_path = os.path.join(workdir, 'final.npz')
    final = f'--config.pretrained_path={shlex.quote(final_path)}'
    # Masked patch pre-training starts from scratch: only a classification run fine-tunes.
    start = (f'fine-tune a classification config from that run with {final}'
             if masked_patches.is_masked(config) else f'fine-tune from that run with {final}')
    if not tf.io.gfile.exists(final_path):  # part-way: nothing to fine-tune from yet
      start = ('go on with that run under the model of its config '
               f'({os.path.join(workdir, "config.json")})')
    raise ConfigError(f'workdir {workdir} holds checkpoints of another model ({e}): use another '
                      f'--workdir, or {start}') from None
  except checkpoint.UnreadableFileError as e:  # the pretrained file, damaged or unreachable
    raise _unreadable_pretrained(config, e) from None
  except checkpoint.IncompatibleCheckpointError as e:  # the pretrained file, another model
    raise ConfigError(f'pretrained_path {config.pretrained_path} does not fit model '
                      f'{config.model_name}: {e}') from None
  param_sh = state_sh['params']
  start = int(_local(state['step']))
  if not start:
    _refuse_retraining_a_final(workdir, ckpt_dir)
  if start > total_steps:
    raise ConfigError(f'workdir {workdir} holds a run at step {start}, past total_steps '
                      f'{total_steps}: set --config.total_steps to {start} or more, or use '
                      'another --workdir')
  if start:
    _check_resumed_classes(config, workdir, num_classes)
    logging.info('Resuming from the checkpoint of step %d in %s', start, workdir)
    if start < total_steps:
      _say_a_new_schedule(workdir, info.num_train_examples, schedule, start)
  # config.json describes the saved results: a resumed run that saves nothing (diverged,
  # refused, killed) leaves the one they were made with.
  config_written = {'done': False}

  def write_config():
    if not config_written['done']:
      rundir.write_config(config, workdir)
      names = input_pipeline.class_names(config)
      if not masked_patches.is_masked(config) and len(names) == num_classes:
        rundir.record_class_names(workdir, names)
      config_written['done'] = True

  if not start:
    write_config()
  if jax.devices()[0].platform == 'cpu':  # what a resumption will run with
    if start and rundir.recorded_cpu_flags(workdir) is None:  # deleted or damaged
      logging.warning(
          'The XLA:CPU flags this run started with are not readable in %s: it resumes under '
          'those chosen now (%s), which may round otherwise than the steps before (not '
          'bit-identical to an unbroken run); they are recorded for the next resume',
          os.path.join(workdir, rundir.CPU_FLAGS_FILE), ' '.join(xla_cpu_flags.last_flags)
          or "XLA's defaults")
    if not start or rundir.recorded_cpu_flags(workdir) is None:
      rundir.record_cpu_flags(workdir, xla_cpu_flags.last_flags)
  flops_per_step = flops.step_flops(config, num_classes)
  peak, peak_source = device_peaks.resolve_peak(config.dtype, config.peak_flops_per_device)
  logging.info(
      '%s: %s', models.describe(config.model_name, **config.model),
      chrono_lib.setup_text(sum(x.size for x in jax.tree.leaves(state['params'])), flops_per_step,
                            peak, peak_source))

  size, n = config.image_size, config.batch_size
  multi_hot = jax.ShapeDtypeStruct((n, info.num_classes), jnp.float32)
  abstract_batch = {
      'image': jax.ShapeDtypeStruct((n, size, size, 3), jnp.float32),
      'label': multi_hot if info.multi_label else jax.ShapeDtypeStruct((n,), jnp.int32)
  }
  if remat_lib.step_compiler_options(config.remat):
    logging.info(
        'remat %s: the step compiles with XLA:CPU\'s default scheduler, under which '
        'the recomputation saves memory (vit_jax/models/remat.py)',
        remat_lib.policy_name(config.remat))
  gelu_note = remat_lib.gelu_remat_note(config.remat, getattr(model, 'dropout_rate', None))
  if gelu_note:
    logging.warning('%s', gelu_note)
  if (step_lib.compiler_options(config) or {}).items() >= step_lib.NO_COMMAND_BUFFERS.items():
    logging.info('the step compiles without XLA:GPU\'s command buffers (CUDA graphs), which '
                 'slowed a ViT\'s step in the preallocated pool (vit_jax/step.py)')
  # A finished run started again trains no step: it evaluates and writes final.npz, without
  # the step's compilation and the peak's second timing (4 of the quickstart's 11 s).
  jitted_step, build_seconds, temp_bytes = None, 0.0, 0
  if start < total_steps:
    t_build = time.perf_counter()
    jitted_step, config = _fitting_train_step(
        config, model, tx, schedule, mesh, (state_sh, batch_sharding, replicated),
        (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                      state), abstract_batch, jax.ShapeDtypeStruct((2,), jnp.uint32)))
    build_seconds = time.perf_counter() - t_build  # ahead-of-time compilation, if any
    # Every local device's temporaries are in this process's heap (CPU devices share it).
    temp_bytes = _temp_bytes(jitted_step) * len(mesh.local_devices)
    if peak_source == 'measured':
      earlier, peak = peak, device_peaks.better_cpu_peak(config.dtype, peak)
      logging.info(
          'peak %s per device, timed again after compiling (%s before): MFU takes the '
          'better', chrono_lib.rate_text(peak), chrono_lib.rate_text(earlier))
  heap_wait = host_memory.TemporariesWait(temp_bytes, platform=jax.devices()[0].platform)
  host_memory.drop_traces()
  # memory_analysis() in _temp_bytes leaves 50-130 MiB of freed pages that the step's
  # buffers do not reuse (benchmarks/README.md, twenty-first session).
  host_memory.release_freed()
  eval_step = jax.jit(
      masked_patches.make_eval_step(model, config) if masked_patches.is_masked(config) else
      make_eval_step(model), in_shardings=(param_sh, batch_sharding), out_shardings=replicated)
  # The parameters evaluated and exported: the Polyak average when config.polyak_decay is set.
  eval_params = (jax.jit(lambda s: polyak.averaged(s['polyak'], s['params']),
                         out_shardings=param_sh)
                 if polyak.enabled(config) else lambda s: s['params'])
  try:
    if writer is None:
      writer = tensorboard_events.EventWriter(workdir, active=jax.process_index() == 0)
    if start == 0:
      writer.write_hparams(tensorboard_events.hparams_of(config))
  except (OSError, tf.errors.OpError) as e:
    raise ConfigError(f'cannot write the metrics to {workdir}: '
                      f'{errors.write_failure(e, workdir)}, or use another --workdir') from None

  train_data = input_pipeline.train_batches(config, global_batch=config.batch_size,
                                            start_step=start)
  batches = input_pipeline.prefetch_to_mesh(
      _checked_labels(train_data, num_classes, config.train_split), batch_sharding, config.prefetch)
  rng = jax.device_put(jax.random.PRNGKey(config.seed), replicated)
  chrono = chrono_lib.Chrono(
      total_steps=total_steps,
      global_batch=config.batch_size,
      num_train_examples=info.num_train_examples,
      num_devices=mesh.size,  # idle devices (mesh_data) count in neither img/s/core nor MFU
      flops_per_step=flops_per_step,
      peak_flops_per_device=peak,
      core_hours_before=checkpoint.saved_core_hours(manager, start) if start else 0.0)
  peak_check = _CpuPeakCheck(chrono, config.dtype)
  profile = trace.StepTrace(os.path.join(workdir, 'profile'), config.profile_first_step,
                            config.profile_steps, resumed_at=start, last_step=total_steps)
  last = total_steps if stop_after_steps is None else min(stop_after_steps, total_steps)
  result = {'step': start}
  masked = masked_patches.is_masked(config)
  metric = 'masked-patch accuracy' if masked else 'top-1 accuracy'
  stop_on_nonfinite = config.get('on_nonfinite', 'stop') == 'stop'
  # Cheap checks: each step's guard is read once the step has run (no stall), the oldest
  # first: the loop dispatches steps ahead of those running, so the previous step's guard
  # was seldom ready, and a diverged run went on to the next forced read (a sync), which
  # comes before every log line, evaluation and save. The guard's values are cumulative: of
  # the guards ready, the newest says all. One process only: hosts that read it at
  # different steps would stop at different steps.
  peek = jax.process_count() == 1
  saves = {'pending': None, 'last': start or None}
  unread_guards = collections.deque()
  reported_skips = 0

  skipped_limit = _skipped_in_a_row_limit(total_steps)

  def check_guard(guard):
    if ((stop_on_nonfinite and int(guard['first_bad']))
        or int(guard['skipped_in_a_row']) >= skipped_limit):
      try:  # a save in flight is of a finite state: the message then names it as kept
        check_save(block=True)
      except TrainingError:
        pass  # not kept; the divergence is what the user must fix first
      raise TrainingError(_guard_message(guard, config, saves['last']))

  def check_save(block):
    """Raises TrainingError if the save in flight failed (block: wait for it)."""
    step = saves['pending']
    if step is None or (not block and manager.is_saving_in_progress()):
      return
    try:
      manager.wait_until_finished()
      manager.check_for_errors()
    except Exception as e:  # pylint: disable=broad-except  (any failure of the write)
      time.sleep(1.0)  # let the failed write's other callbacks finish (and print) first
      raise TrainingError(
          f'the checkpoint of step {step} could not be written to {ckpt_dir}: '
          f'{errors.write_failure(e, ckpt_dir)}{_then_run_again(saves["last"])}') from None
    saves['pending'], saves['last'] = None, step

  def save(step):
    check_guard(_local(state['guard']))  # a non-finite state is never saved
    lost = lock.lost()
    if lost:  # another run may be writing the workdir now: neither save nor clean up there
      raise TrainingError(f'workdir {workdir}: {lost}: this run stops without saving step '
                          f'{step}; check what the workdir holds, then run the same command '
                          'to go on from it')
    check_save(block=True)
    saves['set_aside'] = (_set_aside_earlier_final(workdir, start, info.num_train_examples)
                          or saves.get('set_aside'))
    saves['pending'] = step
    write_config()
    try:
      checkpoint.save_train_state(manager, step, _without_guard(state), force=True,
                                  core_hours=chrono.core_hours())
    except Exception as e:  # pylint: disable=broad-except
      saves['pending'] = None
      raise TrainingError(
          f'the checkpoint of step {step} could not be written to {ckpt_dir}: '
          f'{errors.write_failure(e, ckpt_dir)}{_then_run_again(saves["last"])}') from None

  preemption = _Preemption(workdir)
  if _RECEIVED_OUTSIDE_THE_LOOP:  # received, but its exception was lost
    preemption.close()
    raise _OUTSIDE_THE_LOOP[_RECEIVED_OUTSIDE_THE_LOOP[0]]()
  try:
    for step in range(start + 1, last + 1):
      if profile.before(step, pending=state):  # traced steps run slower: not timed
        chrono.untimed_from(step)
      try:
        try:
          batch = next(batches)
        except tf.errors.ResourceExhaustedError as e:  # a batch larger than the host's memory
          raise TrainingError(
              f'reading the training data ran out of host memory before step {step} '
              f'({errors.op_error_line(e)}): lower --config.batch_size, --config.image_size or '
              '--config.prefetch') from None
        except tf.errors.OpError as e:  # not a write: the except around the loop says so
          raise TrainingError(f'reading the training data failed before step {step}: '
                              f'{errors.op_error_line(e)}: check --config.dataset and '
                              '--config.pp') from None
        t_step = time.perf_counter()
        heap_wait.before_step()
        state, metrics = jitted_step(state, batch, rng)
        if step == start + 1:  # compiled (unless ahead of time) and run: timing starts now
          jax.block_until_ready(metrics)
          chrono.first_step_done(step, build_seconds + time.perf_counter() - t_step)
          logging.info('Compiled the train step and ran step %d in %.1f s', step,
                       chrono.compile_seconds)
      except Exception as e:  # pylint: disable=broad-except
        if 'RESOURCE_EXHAUSTED' in str(e) or 'out of memory' in str(e).lower():
          raise TrainingError(_memory_message(config, None, None, mesh.size)) from None
        raise
      heap_wait.after_step(metrics)
      if profile.after(step, metrics):
        chrono.untimed_through(step)
      if peek:
        unread_guards.append(metrics['guard'])
        ready = None
        while unread_guards and unread_guards[0]['first_bad'].is_ready():
          ready = unread_guards.popleft()
        if ready is not None:
          check_guard(_local(ready))
      check_save(block=False)
      if _due(step, config.log_every_steps) or step == last:
        metrics = _local(metrics)
        guard = metrics.pop('guard')
        check_guard(guard)
        unread_guards.clear()  # this step's guard says what theirs would
        if int(guard['skipped']) > reported_skips:
          reported_skips = int(guard['skipped'])
          logging.warning(
              '%d step(s) so far had a non-finite loss, gradient or update; their updates '
              'were skipped (on_nonfinite=skip)', reported_skips)
        speed = chrono.report(step)
        if peak_source == 'measured':
          speed = peak_check.checked(speed)
        logging.info('step %d/%d  loss %.4f  lr %.3g  %s', step, total_steps, metrics['loss'],
                     metrics['lr'], chrono.log_text(speed))
        writer.write_scalars(
            step, {
                **{
                    k: float(v) for k, v in metrics.items()
                },
                **speed, input_pipeline.SKIPPED_METRIC: train_data.skipped
            })
        result.update(step=step, loss=float(metrics['loss']))
      evaluating = _due(step, config.eval_every_steps) or step == total_steps
      fewshot_due = fewshot and (_due(step, config.fewshot_every_steps) or step == total_steps)
      try:
        if evaluating or fewshot_due:
          check_guard(_local(state['guard']))  # a sync too: the steps before count as training
          # The train step's freed temporaries, which jemalloc would keep beside the evaluation's.
          host_memory.release_freed()
          with chrono.paused():
            params = eval_params(state)
          if evaluating:
            with chrono.paused():
              accuracy, n, undecodable = evaluate(eval_step, params, config, batch_sharding,
                                                  num_classes)
            counted = ((f'{n} patches' if masked else errors.count_of(n, 'example'))
                       + evaluate_lib.not_counted(undecodable))
            logging.info('step %d  %s %s %.4f (%s%s)', step, config.eval_split, metric, accuracy,
                         counted, ', Polyak average' if polyak.enabled(config) else '')
            writer.write_scalars(step, {'accuracy': accuracy})
            result.update(accuracy=accuracy)
            if real:
              with chrono.paused():
                result.update(_evaluate_real(eval_step, params, real, batch_sharding, step, writer))
          if fewshot_due:
            with chrono.paused():
              scores = fewshot(params)
            logging.info('step %d  few-shot linear: %s', step,
                         '  '.join(f'{k[len("fewshot/"):]} {v:.4f}' for k, v in scores.items()))
            writer.write_scalars(step, scores)
            result.update(scores)
          host_memory.release_freed()  # and the evaluation's
      except TrainingError:  # a non-finite state: never saved
        raise
      except Exception:
        # The step's state is kept where a save was due: an evaluation that failed (out of
        # memory, its data) had left the checkpoint before it, and at the last step the
        # same command evaluates the saved state again, training nothing.
        if _due(step, config.checkpoint_every_steps) or step == last:
          _save_after_a_failure(save, check_save, step)
        raise
      result['step'] = step
      preempted = preemption.reached(step)
      if preempted or _due(step, config.checkpoint_every_steps) or step == last:
        check_guard(_local(state['guard']))  # the sync before the pause
        with chrono.paused():
          save(step)
      if preempted and step < total_steps:  # at the last step the run finishes as usual
        check_save(block=True)
        raise _stopped_at(preemption.requested, step, ckpt_dir)
    if heap_wait.summary():
      logging.info('%s', heap_wait.summary())
    if train_data.summary():
      logging.warning('%s', train_data.summary())
    check_save(block=True)
    writer.flush()
    finished = result['step'] == total_steps
    if finished:
      check_guard(_local(state['guard']))
    if finished and 'accuracy' not in result:  # a finished run, started again
      params = eval_params(state)
      result['accuracy'], _, _ = evaluate(eval_step, params, config, batch_sharding, num_classes)
      if real:
        result.update(_evaluate_real(eval_step, params, real, batch_sharding, total_steps, writer))
    if finished:
      # Collective under FSDP or on several hosts; only process 0 writes the file.
      params = multihost_utils.process_allgather(eval_params(state), tiled=True)
      if start < total_steps:  # a finished run started again trained nothing under this config
        write_config()
      if jax.process_index() == 0:
        final = os.path.join(workdir, 'final.npz')
        try:
          checkpoint.save_npz(final, params)
        except (OSError, tf.errors.OpError) as e:
          raise TrainingError(f'{final} could not be written: {errors.write_failure(e, final)}, '
                              'then run the same command to write it (the checkpoint of the '
                              f'last step, {total_steps}, is saved)') from None
        _drop_an_identical_copy(saves.get('set_aside'), final)
      if preemption.requested:  # during the last evaluation, which went on
        logging.warning('%s came after the last step: the run finished all the same',
                        preemption.requested)
      logging.info('Final %s %s: %.4f after %d steps (parameters: %s)', config.eval_split, metric,
                   result['accuracy'], total_steps, os.path.join(workdir, 'final.npz'))
  except (OSError, tf.errors.OpError) as e:
    raise TrainingError(f'cannot write to {workdir}: {errors.write_failure(e, workdir)}, then run '
                        'the same command to resume'
                        + (f' from step {saves["last"]}' if saves['last'] else
                           ' (from the start: no checkpoint had been saved)')) from None
  finally:
    profile.close()
    preemption.close()
    try:
      manager.wait_until_finished()  # never leave a save thread behind
    except Exception:  # pylint: disable=broad-except  (already reported above)
      pass
  result['params'] = eval_params(state)  # what final.npz holds
  return result


def _refuse_retraining_a_final(workdir, ckpt_dir):
  """A run about to start from step 0 in a workdir whose final.npz stays from an earlier
  run (its checkpoints deleted or damaged): training would overwrite that result, as it had,
  silently, where the user had removed the checkpoints to free space."""
  final = os.path.join(workdir, 'final.npz')
  if tf.io.gfile.exists(final):
    raise ConfigError(f'workdir {workdir} holds the final.npz of a finished run but no '
                      f'checkpoint of it in {ckpt_dir}: training again from step 0 would replace '
                      'it: use another --workdir (or fine-tune from it with '
                      f'--config.pretrained_path={shlex.quote(final)}), or move final.npz out of '
                      'the workdir to train there from the start')


def _set_aside_earlier_final(workdir, start, num_train_examples):
  """A finished run taken on to more steps: its final.npz is renamed final.step<N>.npz (N:
  its own step, the total_steps of the config.json it was written with) once a later state
  is saved, so that vit-evaluate and vit-predict do not take the earlier run's parameters
  for this one's (they had, with exit 0, while it was at step 300 of 1500); a sweep sees the
  point unfinished. Kept until then: an extension that diverges before its first save leaves
  the workdir as it was. An earlier final.step<N>.npz is never replaced. Returns the name
  it was given (None: nothing renamed)."""
  final = os.path.join(workdir, 'final.npz')
  if not (start and jax.process_index() == 0 and tf.io.gfile.exists(final)):
    return None
  recorded = rundir.recorded_config(workdir)
  try:  # the restored step where the record is unreadable (config.json is checked at start)
    step = optim.total_steps(recorded, num_train_examples) if recorded else start
  except (AttributeError, KeyError, TypeError, ValueError):
    step = start
  kept = os.path.join(workdir, f'final.step{step}.npz')
  copy = 1
  while tf.io.gfile.exists(kept):
    copy += 1
    kept = os.path.join(workdir, f'final.step{step}.{copy}.npz')
  tf.io.gfile.rename(final, kept)
  if step > start:  # its later checkpoints are gone: those steps are trained again
    logging.warning(
        'Renamed the final.npz of step %d to %s: this run resumed from step %d '
        'and trains its own', step, kept, start)
  else:
    logging.warning('Renamed the final.npz of step %d to %s: this run goes on past it', step, kept)
  return kept


def _drop_an_identical_copy(set_aside, final):
  """Removes `set_aside` (the final.npz that _set_aside_earlier_final renamed) where it holds
  the same bytes as the new `final`: a finished run whose newest checkpoint was deleted
  trains its last steps again to the same result (resume is bit-identical), and had left
  two copies of it."""
  if not (set_aside and tf.io.gfile.exists(set_aside)):
    return
  with tf.io.gfile.GFile(set_aside, 'rb') as a, tf.io.gfile.GFile(final, 'rb') as b:
    while True:
      chunk = a.read(1 << 24)
      if chunk != b.read(1 << 24):
        return
      if not chunk:
        break
  tf.io.gfile.remove(set_aside)
  logging.warning('Removed %s: the new %s holds the same parameters, bit for bit', set_aside, final)


def _save_after_a_failure(save, check_save, step):
  """Saves step `step` while an error is on its way out; a save that fails too is logged,
  not raised, so that the error the user sees is the first one."""
  try:
    save(step)
    check_save(block=True)
    logging.warning('Saved step %d before stopping on the error below', step)
  except Exception as e:  # pylint: disable=broad-except
    logging.error('Step %d could not be saved either: %s', step, errors.one_line(e))


class _CpuPeakCheck:
  """A measured CPU peak timed again where MFU reads over 100%, which no step can do: on a
  shared host the matmul's speed swings from one window to the next (95-206 GFLOP/s while
  the step held steady, benchmarks/README.md, seventy-first session), so every timing so
  far fell in a slow spell. Up to device_peaks.CPU_PEAK_RETIMES times a run (not counted as
  training); if MFU still reads over 100%, one warning names the exact fix."""

  def __init__(self, chrono, dtype):
    self.chrono, self.dtype = chrono, dtype
    self.retimes_left, self.warned = device_peaks.CPU_PEAK_RETIMES, False

  def checked(self, speed):
    """chrono.report's `speed`, its MFU against a better peak if it read over 100%."""
    if speed.get('mfu', 0) <= 1:
      return speed
    if self.retimes_left:
      self.retimes_left -= 1
      earlier = self.chrono.peak_flops_per_device
      with self.chrono.paused():
        peak = device_peaks.better_cpu_peak(self.dtype, earlier)
      self.chrono.peak_flops_per_device = peak
      speed = {**speed, 'mfu': speed['mfu'] * earlier / peak}
      logging.info('MFU read over 100%%: peak %s per device, timed again (%s before)',
                   chrono_lib.rate_text(peak), chrono_lib.rate_text(earlier))
    if speed['mfu'] > 1 and not self.warned:
      self.warned = True
      logging.warning(
          'MFU reads %.0f%%, more than the cores can do: every timing of the CPU peak fell in '
          'a slow spell of this host; set --config.peak_flops_per_device (FLOP/s per device) '
          'for an exact MFU', 100 * speed['mfu'])
    return speed


def _device_memory(config):
  """Bytes per device for the fit check: config.device_memory_mb, else what the device
  reports (GPU/TPU), else None (CPU: _host_share)."""
  if config.get('device_memory_mb', 0) > 0:
    return int(config.device_memory_mb * 2**20)
  stats = jax.local_devices()[0].memory_stats()
  return (stats or {}).get('bytes_limit')


def _host_share(state_bytes, num_local_devices):
  """A CPU device's memory for the fit check: its train state (already resident) and its
  share of what the host can still give (its local devices share it), or None where that
  is unknown. Without it a step far too large was killed by the kernel, with no line."""
  free = host_memory.available_bytes()
  return None if free is None else state_bytes + free // num_local_devices


def _bytes_per_device(abstract_tree, shardings):
  """Bytes of one device's shards of the arrays `abstract_tree` describes."""
  sizes = jax.tree.map(lambda x, s: math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize,
                       abstract_tree, shardings)
  return sum(jax.tree.leaves(sizes))


def _step_memory(compiled):
  """Bytes per device the compiled step needs (arguments + outputs + temporaries)."""
  m = compiled.memory_analysis()
  if m is None:
    return None
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes + m.generated_code_size_in_bytes)


def _temp_bytes(compiled):
  """Bytes of temporaries per device one run of the compiled step allocates (0: unknown)."""
  m = compiled.memory_analysis()
  return 0 if m is None else m.temp_size_in_bytes


def _memory_message(config, need, limit, num_devices, of_host=False, searched=False):
  """The one line for a step that does not fit, naming only the fixes left: not accum_steps
  where it cannot rise (searched: accum_steps 0 tried every count), remat or fsdp where they
  are on, fsdp on one device."""
  size = (f'needs {need / 2**20:.1f} MiB per device, more than the {limit / 2**20:.1f} MiB '
          'available' if need else 'does not fit in device memory')
  if need and of_host:
    size += (' (its state and its share of the host\'s free memory; '
             '--config.device_memory_mb sets it)')
  accum = (f' in {config.accum_steps} micro-batches, the most accum_steps 0 tries'
           if searched else f', accum_steps {config.accum_steps}')
  fixes = []
  if not searched and config.accum_steps < config.batch_size // num_devices:
    fixes.append('raise --config.accum_steps (0 finds the fewest that fit)')
  if not config.remat:
    fixes.append('set --config.remat=True')
  if not config.fsdp and num_devices > 1:
    fixes.append('set --config.fsdp=True')
  lower = 'lower --config.batch_size, --config.image_size or the model size'
  return (f'the train step (batch_size {config.batch_size}{accum}) {size}: '
          + ''.join(f'{fix}, ' for fix in fixes) + ('or ' if fixes else '') + lower)


def _fitting_train_step(config, model, tx, schedule, mesh, in_shardings, abstract_args):
  """(train step, config) where the step fits the device memory.

  accum_steps 0: the fewest micro-batches whose compiled step fits (memory_analysis()
  against _device_memory); otherwise the configured step, checked when the memory is
  known. Compiled ahead of time, so that the compiler's freed memory is handed back to the
  OS before the step's buffers are allocated (vit_jax/host_memory.py).
  """
  limit = _device_memory(config)
  of_host = limit is None and jax.local_devices()[0].platform == 'cpu'
  if of_host:
    limit = _host_share(_bytes_per_device(abstract_args[0], in_shardings[0]),
                        len(mesh.local_devices))
    of_host = limit is not None

  def jitted(c):
    return step_lib.jit(model, tx, schedule, c, mesh, in_shardings)

  n_dev = mesh.size
  batch = config.batch_size
  candidates = ([config.accum_steps] if config.accum_steps > 0 else
                [a for a in range(1, batch + 1) if batch % a == 0 and (batch // a) % n_dev == 0])
  need = None
  for accum in candidates:
    c = config.copy_and_resolve_references()
    c.accum_steps = accum
    compiled = jitted(c).lower(*abstract_args).compile()
    need = _step_memory(compiled)
    host_memory.release_freed()  # after memory_analysis(), which leaves freed pages too
    if limit is None or need is None or need <= limit:
      if config.accum_steps == 0 or accum > 1:
        dropout = any(config.model.get(f, 0) for f in ('dropout_rate', 'attention_dropout_rate'))
        logging.info(
            'accum_steps %d: %d micro-batch(es) of %d per step%s%s', config.accum_steps, accum,
            batch // accum, '' if limit is None or need is None else
            f' fit ({need / 2**20:.1f} of {limit / 2**20:.1f} MiB per device)',
            '; each draws its own dropout masks: another count trains with other draws (the '
            'same rate)' if dropout and accum > 1 else '')
      return compiled, c
  raise TrainingError(
      _memory_message(c, need, limit, n_dev, of_host, searched=config.accum_steps == 0))


def _say_a_new_schedule(workdir, num_train_examples, schedule, start):
  """Logs the step where a resume changes the learning rate (resume_changes of total_steps,
  base_lr, ...): a finished run taken on to more steps jumps from about end_lr back up the
  new schedule, which the log had shown only as a new lr at the next log line."""
  old = rundir.recorded_config(workdir)
  try:
    before = optim.learning_rate_schedule(old, optim.total_steps(old, num_train_examples))
    was, now = float(before(start)), float(schedule(start))
    last = float(before(start - 1))  # the lr of the saved run's last update
  except Exception:  # pylint: disable=broad-except  (no record, or one of another version)
    return
  if not math.isclose(was, now, rel_tol=1e-6, abs_tol=1e-12):
    logging.warning(
        'The learning-rate schedule is this config\'s, not the run\'s: step %d trains at lr '
        '%.3g, where step %d trained at %.3g', start + 1, now, start, last)


def _without_guard(state):
  return {k: v for k, v in state.items() if k != 'guard'}


def _due(step, every):
  """Whether a period of `every` steps (0: never; the loop adds the last step) ends at `step`."""
  return every > 0 and step % every == 0


def _stopped_at(requested, step, ckpt_dir):
  """The StoppedBySignal of a run that saved `step` on the signal `requested` (None on
  several processes, where only SIGTERM reaches the loop)."""
  resume = f'checkpoint saved in {ckpt_dir}; run the same command to resume'
  if requested == 'SIGINT':
    return errors.StoppedBySignal(f'interrupted (Ctrl-C) at step {step}: {resume}', signal.SIGINT)
  if requested == 'SIGHUP':
    return errors.StoppedBySignal(
        f'the terminal closed (SIGHUP) at step {step}: {resume} (under nohup, tmux or screen a '
        'run outlives its terminal)', signal.SIGHUP)
  return errors.StoppedBySignal(f'preempted (SIGTERM) at step {step}: {resume}', signal.SIGTERM)


class _Preemption:
  """SIGTERM (what a preempted TPU VM receives), Ctrl-C or a closed terminal -> stop at a
  step every host agrees on, after saving a checkpoint.

  One process: a Python handler sets a flag checked after each step. Once the checkpoint
  is written, the run ends with StoppedBySignal (status 143, 130 or 129: a run that did not
  finish never exits 0; SIGHUP had ended it at once, unsaved), and a second Ctrl-C exits
  at once (status 130) without saving. A SIGHUP the run was started to ignore (nohup) stays
  ignored. Several processes: JAX's preemption sync manager (set up by
  jax.distributed.initialize, notified of SIGTERM) picks the step, so all hosts save the
  same one; Ctrl-C and SIGHUP keep Python's default there.
  """

  def __init__(self, workdir=None):
    """`workdir`: the run's, whose train.INFO gets the line of a second Ctrl-C too and whose
    lock that exit removes."""
    self.workdir = workdir
    self.requested = None  # None, 'SIGTERM', 'SIGINT' or 'SIGHUP'
    self._previous = {}
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
          continue  # started under nohup
        self._previous[sig] = signal.signal(sig, self._on_signal)

  def _on_signal(self, signum, frame):
    del frame
    if signum == signal.SIGINT and self.requested is not None:
      line = (f'{errors.PROGRAM}: second Ctrl-C: stopped at once, without saving this step: run '
              'the same command to resume from the last complete checkpoint (from step 0 if '
              'none was written)\n').encode()
      os.write(2, line)
      if self.workdir:  # os calls only: logging could wait on a lock the loop holds
        rundir.leave_at_once(self.workdir, line)
      os._exit(130)  # pylint: disable=protected-access
    if self.requested is None:
      if signum == signal.SIGINT:
        logging.warning('Ctrl-C: saving a checkpoint after this step, then exiting (Ctrl-C '
                        'again stops at once, without saving)')
      elif signum == signal.SIGHUP:
        logging.warning('SIGHUP (the terminal closed): saving a checkpoint after this step, '
                        'then exiting')
      else:
        logging.warning('SIGTERM: saving a checkpoint after this step, then exiting')
      self.requested = signal.Signals(signum).name

  def reached(self, step):
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.requested is not None

  def close(self):
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous = {}
