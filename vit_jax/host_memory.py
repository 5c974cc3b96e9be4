"""The C heap around the compiled train step on a CPU host.

`release_freed`: compiling a large step allocates about a gigabyte of small objects in XLA's
compiler, and frees them when done. The C heap keeps freed small-object pages, while the
step's buffers are large enough not to fit in them: without a release, the process's peak
RSS is the compiler's leftovers plus the step (R50+ViT-B/16 b8 f32 on CPU under glibc: 3.03
GiB, 2.51 with `malloc_trim`; benchmarks/README.md, seventh session). Under jemalloc
(preloaded by vit-train, host_allocator.py, and told never to purge on its own) the release
is a purge of every arena.

`TemporariesWait`: under jemalloc, holds the loop after each step until that step's
temporaries are back in the heap, so that the next step reuses their pages. XLA:CPU frees
them only after it has signalled the step's outputs ready; a step dispatched at once finds
them still taken, jemalloc maps a second extent for it, and keeps both for good (peak RSS +
one step's temporaries: R50+ViT-B/16 b8 3.6 -> 5.7 GiB in 6 of 8 runs, even with
synchronous dispatch; benchmarks/README.md, ninth and tenth sessions).

`available_bytes`: the host memory a CPU run's fit check counts on (train.py).

`drop_traces`: once the step is compiled, JAX's caches of what was traced to build it.
"""
import ctypes
import ctypes.util
import gc
import logging
import time

import jax

_ALL_ARENAS_PURGE = b'arena.4096.purge'  # 4096 = MALLCTL_ARENAS_ALL
# Below this, a second extent of temporaries costs little and the wait is not worth it.
MIN_TEMP_BYTES = 64 << 20


def _jemalloc_mallctl():
  """jemalloc's `mallctl` where jemalloc is this process's malloc, else None."""
  return getattr(ctypes.CDLL(None), 'mallctl', None)


def release_freed():
  """Purges jemalloc's arenas where it is loaded, else glibc's `malloc_trim(0)`; nothing
  where the C library has neither. Whether it ran."""
  mallctl = _jemalloc_mallctl()
  if mallctl is not None:
    return mallctl(_ALL_ARENAS_PURGE, None, None, None, ctypes.c_size_t(0)) == 0
  name = ctypes.util.find_library('c')
  try:
    trim = ctypes.CDLL(name).malloc_trim
  except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl), or no libc found
    return False
  trim(0)
  return True


def available_bytes():
  """Memory this host can still give the process: Linux's MemAvailable, or less where a
  cgroup (a container's limit) allows less; None where neither can be read."""
  found = []
  try:
    with open('/proc/meminfo', encoding='ascii') as f:
      found += [int(line.split()[1]) * 1024 for line in f if line.startswith('MemAvailable:')]
  except (OSError, ValueError, IndexError):
    pass
  for limit, usage in (
      ('memory.max', 'memory.current'),  # cgroup v2, then v1
      ('memory/memory.limit_in_bytes', 'memory/memory.usage_in_bytes')):
    try:
      with open(f'/sys/fs/cgroup/{limit}', encoding='ascii') as f:
        limit_bytes = f.read().strip()
      with open(f'/sys/fs/cgroup/{usage}', encoding='ascii') as f:
        found.append(int(limit_bytes) - int(f.read().strip()))
    except (OSError, ValueError):  # no such cgroup, or 'max' (no limit)
      pass
  return min(found) if found else None


def drop_traces():
  """Empties JAX's caches of traced and lowered computations: the jaxprs of every function
  traced so far (the state's initialisation, the step's custom VJPs, jax.numpy's own) and
  their lowerings. Once the step is compiled the loop runs its compiled executable, which
  keeps what it needs; the caches held 20 MiB of host memory at the bf16 ViT-Ti/16 b32
  step's peak and 35 at R50+ViT-B/16 b8's (benchmarks/README.md, sixty-ninth session). A
  function jitted before and called again later compiles once more."""
  jax.clear_caches()
  gc.collect()


def _allocated_bytes(mallctl):
  """jemalloc's count of bytes the program holds (refreshed: stats are a snapshot per
  'epoch'), or None where its statistics are not built in."""
  epoch = ctypes.c_uint64(1)
  if mallctl(b'epoch', None, None, ctypes.byref(epoch), ctypes.c_size_t(8)) != 0:
    return None
  value, size = ctypes.c_size_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
  if mallctl(b'stats.allocated', ctypes.byref(value), ctypes.byref(size), None,
             ctypes.c_size_t(0)) != 0:
    return None
  return value.value


class TemporariesWait:
  """Around each step (see the module doc): notes what jemalloc holds before the step, and
  after it waits until jemalloc holds no more than half of `temp_bytes` (the step's
  temporaries on all of this process's devices) above that.

  A no-op (the loop's dispatch stays asynchronous) under any other malloc, off CPU, or for
  temporaries under MIN_TEMP_BYTES. Each wait gives up after `bound_s`; after
  `give_ups_allowed` give-ups in a row it stops waiting, with a warning, since what it waits
  for is then not coming (another thread's allocations).
  """

  def __init__(self, temp_bytes, *, platform='cpu', bound_s=0.05, give_ups_allowed=3, poll_s=1e-4):
    wanted = platform == 'cpu' and temp_bytes >= MIN_TEMP_BYTES
    self._mallctl = _jemalloc_mallctl() if wanted else None
    self.enabled = self._mallctl is not None and _allocated_bytes(self._mallctl) is not None
    self._base = None
    self._slack = temp_bytes // 2
    self._bound_s, self._poll_s = bound_s, poll_s
    self._give_ups_allowed = give_ups_allowed
    self._give_ups_in_a_row = 0
    self.steps = self.give_ups = 0
    self.waited_s = 0.0

  def before_step(self):
    """Notes what jemalloc holds: call just before the step is dispatched."""
    if self.enabled:
      self._base = _allocated_bytes(self._mallctl)

  def after_step(self, outputs):
    """Blocks until `outputs` (of the step just dispatched) are ready and its temporaries
    freed, or the bound is reached."""
    if not self.enabled:
      return
    jax.block_until_ready(outputs)
    t = time.perf_counter()
    deadline = t + self._bound_s
    allocated = _allocated_bytes(self._mallctl)
    while allocated > self._base + self._slack and time.perf_counter() < deadline:
      time.sleep(self._poll_s)
      allocated = _allocated_bytes(self._mallctl)
    self.steps += 1
    self.waited_s += time.perf_counter() - t
    if allocated <= self._base + self._slack:
      self._give_ups_in_a_row = 0
      return
    self.give_ups += 1
    self._give_ups_in_a_row += 1
    if self._give_ups_in_a_row >= self._give_ups_allowed:
      self.enabled = False
      logging.warning(
          'host heap: %d steps in a row, jemalloc still held %.0f MiB more than before the '
          'step %.0f ms after it; no longer waiting for its temporaries (peak RSS may grow '
          'by one step\'s temporaries)', self._give_ups_in_a_row, (allocated - self._base) / 2**20,
          self._bound_s * 1e3)

  def summary(self):
    """One line for the run's log, or '' where it never waited."""
    if not self.steps:
      return ''
    return (f'host heap: waited {self.waited_s / self.steps * 1e3:.2f} ms per step for the '
            f'step\'s temporaries to be freed ({self.give_ups} of {self.steps} waits gave up)')
