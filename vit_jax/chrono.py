"""The loop's speedometer: img/s/core, MFU, progress, epoch, core-hours and ETA.

    chrono = Chrono(total_steps=..., global_batch=..., num_train_examples=...,
                    num_devices=jax.device_count(), flops_per_step=..., peak_flops_per_device=...)
    chrono.first_step_done(step, compile_seconds)   # after the first (compiling) step
    with chrono.paused(): ...                        # evaluation, few-shot, checkpoint saves
    chrono.untimed_from(step); ...; chrono.untimed_through(step)  # steps under the profiler
    scalars = chrono.report(step)                    # at a log step, after a device sync
    logging.info('... %s', chrono.log_text(scalars))

As big_vision's Chrono: timing starts when the first step (compilation included) is done,
paused time is left out of the speed, and the speed is that of the interval since the
previous report, while the ETA is the average since timing started, pauses included (the
evaluations to come take time too). Pure Python: the caller syncs the device before it
reports or pauses, so queued steps are not timed as evaluation.

Choices:
  * img/s/core and MFU are per JAX device: global examples / seconds / num_devices, and the
    model's FLOPs (vit_jax.flops, remat's recomputation not counted) per second over the
    peak of all devices.
  * Steps run under the profiler (untimed_from .. untimed_through) are left out of the
    speed, their time and their count both: tracing slows them down.
  * examples_seen is step * global_batch: steps of earlier runs of a resumed job count.
  * core_hours is num_devices * wall hours since the Chrono was made (compilation,
    evaluation and saves included: the devices are held throughout), plus those of the
    earlier processes of a resumed run up to the checkpoint it resumed from
    (`core_hours_before`, kept with each checkpoint), as big_vision carries them over.
"""
import contextlib
import time


def hms(seconds):
  """'H:MM:SS' of a non-negative duration."""
  seconds = int(seconds)
  return f'{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'


def _si(value):
  """'23.5 G', '989 T': three significant figures and the prefix that keeps them < 1000."""
  for prefix, scale in (('M', 1e6), ('G', 1e9), ('T', 1e12), ('P', 1e15)):
    if value < 999.5 * scale:
      return f'{value / scale:.3g} {prefix}'
  return f'{value / 1e18:.3g} E'


def rate_text(flop_s):
  """'23.5 GFLOP/s'."""
  return f'{_si(flop_s)}FLOP/s'


def setup_text(num_params, flops_per_step, peak_flops_per_device, peak_source):
  """The start-up facts, e.g. '141,066 parameters; 1.53 GFLOP per step; peak 23.5 GFLOP/s
  per device (measured)'; says why MFU will be missing."""
  parts = [f'{num_params:,} parameters']
  parts.append(f'{_si(flops_per_step)}FLOP per step')
  parts.append(f'no peak FLOP/s known for {peak_source} (no MFU; set '
               '--config.peak_flops_per_device)' if peak_flops_per_device is
               None else f'peak {rate_text(peak_flops_per_device)} per device ({peak_source})')
  return '; '.join(parts)


class Chrono:
  """Measures training speed and progress; see the module docstring."""

  def __init__(self, *, total_steps, global_batch, num_train_examples, num_devices,
               flops_per_step=None, peak_flops_per_device=None, core_hours_before=0.0,
               clock=time.perf_counter):
    if total_steps <= 0 or global_batch <= 0 or num_devices <= 0:
      raise ValueError(f'total_steps ({total_steps}), global_batch ({global_batch}) and '
                       f'num_devices ({num_devices}) must be positive')
    self.total_steps = total_steps
    self.global_batch = global_batch
    self.num_train_examples = num_train_examples
    self.num_devices = num_devices
    self.flops_per_step = flops_per_step
    self.peak_flops_per_device = peak_flops_per_device
    self.compile_seconds = None
    self._core_hours_before = core_hours_before
    self._clock = clock
    self._created = clock()
    self._timing_start = None  # (time, step) once the first step is done
    self._last = None  # (time, step) of the previous report
    self._paused_since_last = 0.0
    self._pause_depth = 0
    self._pause_start = None
    self._untimed_after = None  # the last timed step, while steps are left out
    self._untimed_steps_since_last = 0
    self._compile_reported = False

  def first_step_done(self, step, compile_seconds):
    """Starts the clock: `step` (the first of this run) took `compile_seconds` to compile
    and run."""
    now = self._clock()
    self.compile_seconds = float(compile_seconds)
    self._timing_start = self._last = (now, step)
    self._paused_since_last = 0.0  # pauses before timing starts do not count
    if self._pause_depth:  # inside a pause (a trace of the first steps): it starts now
      self._pause_start = now
    if self._untimed_after is not None:
      self._untimed_after = step

  def untimed_from(self, step):
    """Leaves `step` and those after it out of the speed, until untimed_through. Sync the
    device first, as for a pause."""
    self._untimed_after = step - 1
    self._enter_pause()

  def untimed_through(self, step):
    """Ends untimed_from's window after `step` (synced: its outputs are ready)."""
    self._untimed_steps_since_last += step - self._untimed_after
    self._untimed_after = None
    self._leave_pause()

  @contextlib.contextmanager
  def paused(self):
    """Time inside does not count as training. Sync the device first (block on the state),
    or the steps still running there are counted as the pause."""
    self._enter_pause()
    try:
      yield
    finally:
      self._leave_pause()

  def _enter_pause(self):
    self._pause_depth += 1
    if self._pause_depth == 1:
      self._pause_start = self._clock()

  def _leave_pause(self):
    self._pause_depth -= 1
    if self._pause_depth == 0:
      self._paused_since_last += self._clock() - self._pause_start
      self._pause_start = None

  def core_hours(self):
    """Device-hours of the run so far, those before a resume included."""
    return self._core_hours_before + self.num_devices * (self._clock() - self._created) / 3600

  def report(self, step):
    """Scalars at `step` (TensorBoard names); a speed needs one earlier report or
    first_step_done, MFU a FLOP count and a peak, epoch a training-set size."""
    now = self._clock()
    examples = step * self.global_batch
    scalars = {
        'progress': step / self.total_steps,
        'examples_seen': float(examples),
        'core_hours': self._core_hours_before + self.num_devices * (now - self._created) / 3600
    }
    if self.num_train_examples and self.num_train_examples > 0:
      scalars['epoch'] = examples / self.num_train_examples
    if self.compile_seconds is not None and not self._compile_reported:
      scalars['compile_seconds'] = self.compile_seconds
      self._compile_reported = True
    if self._pause_depth:  # reported inside a pause (a traced window): count it up to now
      self._paused_since_last += now - self._pause_start
      self._pause_start = now
    if self._untimed_after is not None:
      self._untimed_steps_since_last += step - self._untimed_after
      self._untimed_after = step
    if self._last is not None and step > self._last[1]:
      seconds = now - self._last[0] - self._paused_since_last
      steps = step - self._last[1] - self._untimed_steps_since_last
      if seconds > 0 and steps > 0:
        scalars['steps_per_sec'] = steps / seconds
        scalars['img_per_sec_per_core'] = (steps * self.global_batch / seconds / self.num_devices)
        if self.flops_per_step and self.peak_flops_per_device:
          scalars['mfu'] = (steps * self.flops_per_step / seconds /
                            (self.peak_flops_per_device * self.num_devices))
      start_time, start_step = self._timing_start
      scalars['eta_seconds'] = ((now - start_time) / (step - start_step) *
                                (self.total_steps - step))
      self._last = (now, step)
      self._paused_since_last = 0.0
      self._untimed_steps_since_last = 0
    return scalars

  def log_text(self, scalars):
    """The tail of a log line, e.g. '12.3 img/s/core  MFU 41.2%  epoch 0.52  3.1%  ETA
    0:12:03'; what `scalars` lacks is left out."""
    parts = []
    if 'img_per_sec_per_core' in scalars:
      parts.append(f'{scalars["img_per_sec_per_core"]:.1f} img/s/core')
    if 'mfu' in scalars:
      parts.append(f'MFU {100 * scalars["mfu"]:.1f}%')
    if 'epoch' in scalars:
      parts.append(f'epoch {scalars["epoch"]:.2f}')
    parts.append(f'{100 * scalars["progress"]:.1f}%')
    if 'eta_seconds' in scalars:
      parts.append(f'ETA {hms(scalars["eta_seconds"])}')
    return '  '.join(parts)
