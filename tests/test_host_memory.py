"""vit_jax.host_memory: release_freed hands freed heap pages back to the OS (glibc), as after a
compilation; under jemalloc, TemporariesWait holds the loop until a step's temporaries are
freed; drop_traces empties JAX's trace caches and leaves a compiled step runnable."""
import logging
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from tests.conftest import ROOT, installed_jemalloc
from vit_jax import host_allocator
from vit_jax import host_memory

# In a child: 200,000 1 KiB blocks malloc'd and freed except the last one, which keeps
# glibc from trimming the heap top by itself (the compiler's leftovers look like this).
CHILD = r'''
import ctypes, ctypes.util
from vit_jax import host_memory
libc = ctypes.CDLL(ctypes.util.find_library('c'))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss_mib():
  with open('/proc/self/status') as f:
    return int(next(l for l in f if l.startswith('VmRSS')).split()[1]) / 1024
blocks = [libc.malloc(1024) for _ in range(200_000)]
for b in blocks:
  ctypes.memset(b, 1, 1024)
for b in blocks[:-1]:
  libc.free(b)
freed = rss_mib()
ran = host_memory.release_freed()
print(ran, freed - rss_mib())
'''


def test_release_freed_returns_freed_heap_pages():
  out = subprocess.run([sys.executable, '-c', CHILD], capture_output=True, text=True, check=True)
  ran, dropped_mib = out.stdout.split()
  assert ran == 'True'  # Linux with glibc, as on the hosts vit_jax trains on
  assert float(dropped_mib) > 100, out.stdout  # ~200 MiB were freed but still resident


class _Heap:
  """A stand-in for jemalloc's `stats.allocated`: the readings given, then the last one."""

  def __init__(self, *readings):
    self.readings = list(readings)
    self.reads = 0

  def allocated(self, mallctl):
    del mallctl
    self.reads += 1
    return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def _fake_jemalloc(monkeypatch, heap):
  monkeypatch.setattr(host_memory, '_jemalloc_mallctl', lambda: lambda *args: 0)
  monkeypatch.setattr(host_memory, '_allocated_bytes', heap.allocated)


MIB = 1 << 20


def _step(wait):
  wait.before_step()
  wait.after_step(jnp.zeros(3))


def test_the_wait_holds_the_loop_until_the_temporaries_are_freed(monkeypatch):
  # Before the step: 1000 MiB; its 256 MiB of temporaries are freed on the third reading.
  heap = _Heap(1000 * MIB)
  _fake_jemalloc(monkeypatch, heap)
  wait = host_memory.TemporariesWait(256 * MIB)
  assert wait.enabled
  heap.readings, heap.reads = [1000 * MIB, 1256 * MIB, 1256 * MIB, 1001 * MIB], 0
  _step(wait)
  assert heap.reads == 4 and wait.give_ups == 0 and wait.enabled
  assert '(0 of 1 waits gave up)' in wait.summary()


def test_the_wait_is_bounded_and_stops_after_three_give_ups_in_a_row(monkeypatch, caplog):
  heap = _Heap(1000 * MIB)
  _fake_jemalloc(monkeypatch, heap)
  wait = host_memory.TemporariesWait(256 * MIB, bound_s=0.02)
  with caplog.at_level(logging.WARNING):
    heap.readings = [1000 * MIB, 1256 * MIB]  # not freed within the bound
    t = time.perf_counter()
    _step(wait)
    assert 0.02 <= time.perf_counter() - t < 0.5
    assert wait.give_ups == 1 and wait.enabled
    heap.readings = [1256 * MIB, 1300 * MIB]  # the next step's are freed: the count restarts
    _step(wait)
    assert wait.give_ups == 1 and wait.enabled
    for _ in range(3):  # three give-ups in a row
      heap.readings = [1000 * MIB, 1256 * MIB]
      _step(wait)
  assert not wait.enabled and wait.give_ups == 4 and wait.steps == 5
  assert 'no longer waiting for its temporaries' in caplog.text
  reads = heap.reads
  _step(wait)
  assert heap.reads == reads  # off for the rest of the run


@pytest.mark.parametrize('temp_bytes, platform', [(32 * MIB, 'cpu'), (256 * MIB, 'tpu')])
def test_no_wait_for_small_temporaries_or_off_cpu(monkeypatch, temp_bytes, platform):
  _fake_jemalloc(monkeypatch, _Heap(1000 * MIB))
  wait = host_memory.TemporariesWait(temp_bytes, platform=platform)
  _step(wait)
  assert not wait.enabled and wait.summary() == ''


# In a child: a thread holds 256 MiB (a step's temporaries) for 30 ms after the wait starts.
# The wait's bound is 2 s, not the loop's 50 ms, so that a loaded host's late thread is not
# counted as a give-up: a wait that ends well before the bound ended because the memory was freed.
WAIT_CHILD = r'''
import ctypes, threading, time
import jax.numpy as jnp
from vit_jax import host_memory
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
outputs = jnp.zeros(3)
wait = host_memory.TemporariesWait(256 << 20, bound_s=2.0)
taken = threading.Event()
wait.before_step()
def step():
  block = libc.malloc(256 << 20)
  taken.set()
  time.sleep(0.03)
  libc.free(block)
thread = threading.Thread(target=step)
thread.start()
taken.wait()
wait.after_step(outputs)
thread.join()
print(wait.enabled, wait.give_ups, wait.waited_s)
'''


def _wait_in_child(env):
  out = subprocess.run([sys.executable, '-c', WAIT_CHILD], env=env, capture_output=True, text=True,
                       check=True, cwd=ROOT)
  enabled, give_ups, waited_s = out.stdout.split()
  return enabled == 'True', int(give_ups), float(waited_s)


def test_under_the_c_library_malloc_there_is_no_wait():
  env = {k: v for k, v in os.environ.items() if k not in ('LD_PRELOAD', 'MALLOC_CONF')}
  assert _wait_in_child(env) == (False, 0, 0.0)


@pytest.mark.skipif(installed_jemalloc() is None, reason='jemalloc is not installed on this host')
def test_under_jemalloc_the_wait_ends_when_the_memory_is_freed():
  env = dict(os.environ, LD_PRELOAD=installed_jemalloc(), MALLOC_CONF=host_allocator.MALLOC_CONF)
  enabled, give_ups, waited_s = _wait_in_child(env)
  assert enabled and give_ups == 0
  assert 0.02 <= waited_s < 1.0  # the 30 ms the memory was held (longer on a loaded host)


def test_drop_traces_empties_the_trace_caches_and_keeps_the_compiled_step():
  # The loop keeps its compiled step and drops what JAX traced and lowered to build it.
  traced = []

  def step(x):
    traced.append(x.shape)
    return jnp.sin(x) * 2

  jitted = jax.jit(step)
  compiled = jitted.lower(jnp.ones((4,))).compile()
  jitted(jnp.ones((4,)))
  assert len(traced) == 1  # lowering and the call share one trace
  host_memory.drop_traces()
  assert float(compiled(jnp.ones((4,)))[0]) == pytest.approx(2 * math.sin(1.0))
  jitted(jnp.ones((4,)))
  assert len(traced) == 2  # traced afresh: nothing was left in the caches


def test_available_bytes_is_what_the_host_has_free():
  """The CPU fit check's memory (train.py): positive, and no more than the host has."""
  free = host_memory.available_bytes()
  assert 0 < free <= os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'), free
