"""A jax.profiler trace of chosen training steps, for TensorBoard's profile tab.

    trace = StepTrace(os.path.join(workdir, 'profile'), first_step=10, num_steps=5)
    for step in ...:
      started = trace.before(step, pending=state)
      state, metrics = train_step(...)
      stopped = trace.after(step, metrics)
    trace.close()  # in a `finally`: stops a trace the run ended inside

Steps [first_step, first_step + num_steps) are traced; num_steps 0 traces nothing. A run
resumed inside the window traces the rest of it; one resumed after it traces nothing and
says so (a warning, not an error: a preempted run resumes with the flags it started with).
Each host writes its own trace and logs one line saying which steps it holds and where it is.
"""
from absl import logging
import jax


def validate(first_step, num_steps, last_step=None):
  """A one-line ValueError naming the config fields if the window is out of range, or (with
  `last_step`, the run's last step, where known) starts after the run ends."""
  if num_steps < 0 or first_step < 0 or (num_steps and first_step < 1):
    raise ValueError(f'profile_first_step {first_step} / profile_steps {num_steps}: set '
                     '--config.profile_first_step to 1 or more and --config.profile_steps to '
                     'the number of steps to trace (0: no trace)')
  if num_steps and last_step is not None and first_step > last_step:
    raise ValueError(f'profile_first_step {first_step} is after the run\'s last step '
                     f'{last_step}, so nothing would be traced: set --config.profile_first_step '
                     f'to a step from 1 to {last_step}')


class StepTrace:
  """Starts jax.profiler before the window's first step, stops after its last."""

  def __init__(self, logdir, first_step, num_steps, resumed_at=0, last_step=None):
    """`resumed_at`: the step of the state the run starts from (0 for a new run);
    `last_step`: the run's last step, where known."""
    validate(first_step, num_steps)
    self.logdir = logdir
    self.first_step = first_step
    self.end_step = first_step + num_steps  # one past the last traced step
    self.active = False
    self.done = num_steps == 0
    if self.done and first_step:
      logging.warning(
          'No profiler trace in this run: profile_first_step is %d but profile_steps is 0; set '
          '--config.profile_steps to the number of steps to trace', first_step)
    self.traced = []  # the first and the last step traced so far
    if not self.done and self.end_step - 1 <= resumed_at:
      next_step = resumed_at + 1
      if last_step is not None and last_step < next_step:
        fix = f'the run has no steps left after step {resumed_at}'
      else:
        fix = f'set --config.profile_first_step to {next_step} or later to trace again'
      logging.warning(
          'No profiler trace in this run: its window, steps %d-%d, lies before step %d, where '
          'the run resumes; %s', first_step, self.end_step - 1, next_step, fix)
      self.done = True

  def before(self, step, pending=None):
    """Starts the trace if `step` is inside the window and no trace ran yet, once `pending`
    (the earlier steps' outputs) are computed; True if it started."""
    if not self.done and not self.active and self.first_step <= step < self.end_step:
      jax.block_until_ready(pending)
      jax.profiler.start_trace(self.logdir)
      self.active = True
      self.traced = [step, step]
      return True
    return False

  def after(self, step, outputs=None):
    """Stops the trace after the window's last step, once `outputs` are computed; True if
    it stopped."""
    if self.active:
      self.traced[1] = step
      if step >= self.end_step - 1:
        self._stop(outputs)
        return True
    return False

  def close(self):
    """Stops a trace still running (the run ended inside the window)."""
    if self.active:
      self._stop(None)

  def _stop(self, outputs):
    try:
      jax.block_until_ready(outputs)
    finally:
      jax.profiler.stop_trace()
      self.active, self.done = False, True
    first, last = self.traced
    steps = f'step {first}' if first == last else f'steps {first}-{last}'
    logging.info(
        'Profiler trace of %s in %s: view it with `xprof --logdir=%s` or in '
        "TensorBoard's Profile tab (`pip install xprof`)", steps, self.logdir, self.logdir)
