"""tf.data's threads at idle CPU priority where the train step runs on the same cores.

On a CPU backend the step's XLA threads and the input pipeline's threads share the cores.
At the same priority the kernel's fair scheduler takes the pipeline's time (JPEG decoding,
crops, file reads) out of the step's, although the step leaves cores idle part of the time
(XLA:CPU runs fewer thunks than there are cores at many moments). Threads of Linux's
SCHED_IDLE policy run only where a core would otherwise idle, so the pipeline fills the
step's gaps instead. It cannot starve the run: `prefetch` keeps batches ready, and when the
step waits for a batch its cores are idle and the pipeline runs. (Other processes' work
comes first too: on a host shared with other jobs the pipeline gets what they leave.) The
loop against the bare step: benchmarks/README.md (twenty-seventh session).

tf.data starts its threads (the parallel map's workers, the prefetch thread) when an
iterator is created and first read, and a new thread inherits its creator's policy. So
`numpy_iterator` creates the iterator and reads its first element on a short-lived thread
that has put itself in SCHED_IDLE: only the pipeline's threads change, never XLA's or the
loop's. On TPU and GPU backends the host's cores are the pipeline's own, so nothing changes
there; nor where the policy is not available (not Linux) or refused.
"""
import os
import threading

import jax

ENABLED = True  # benchmarks/loop.py --normal_priority_too sets it False to compare


def applies():
  """Whether pipelines started now get idle priority: a CPU backend on Linux."""
  return ENABLED and hasattr(os, 'SCHED_IDLE') and jax.default_backend() == 'cpu'


def numpy_iterator(ds):
  """`ds.as_numpy_iterator()` and its first element (raises what reading it raises, and
  StopIteration for an empty dataset), its threads started at idle priority where
  `applies()`."""
  if not applies():
    iterator = ds.as_numpy_iterator()
    return iterator, next(iterator)
  result = {}

  def start():
    try:
      os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
    except OSError:  # a container may refuse it: normal priority then
      pass
    try:
      iterator = ds.as_numpy_iterator()
      result['value'] = iterator, next(iterator)
    except BaseException as e:  # pylint: disable=broad-except  (re-raised by the caller)
      result['error'] = e

  thread = threading.Thread(target=start, name='input pipeline start', daemon=True)
  thread.start()
  thread.join()
  if 'error' in result:
    raise result['error']
  return result['value']
