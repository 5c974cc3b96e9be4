"""Hands the C heap's freed pages back to the OS once a step is compiled.

Compiling a large step allocates about a gigabyte of small objects in XLA's compiler, and
frees them when done. The C heap keeps freed small-object pages, while the step's buffers
are large enough not to fit in them: without a release, the process's peak RSS is the
compiler's leftovers plus the step (R50+ViT-B/16 b8 f32 on CPU under glibc: 3.03 GiB, 2.51
with `malloc_trim`; benchmarks/README.md, seventh session). Under jemalloc (preloaded by
vit-train, host_allocator.py, and told never to purge on its own) the release is a purge of
every arena.
"""
import ctypes
import ctypes.util

_ALL_ARENAS_PURGE = b'arena.4096.purge'  # 4096 = MALLCTL_ARENAS_ALL


def release_freed():
  """Purges jemalloc's arenas where it is loaded, else glibc's `malloc_trim(0)`; nothing
  where the C library has neither. Whether it ran."""
  process = ctypes.CDLL(None)
  mallctl = getattr(process, 'mallctl', None)
  if mallctl is not None:
    return mallctl(_ALL_ARENAS_PURGE, None, None, None, ctypes.c_size_t(0)) == 0
  name = ctypes.util.find_library('c')
  try:
    trim = ctypes.CDLL(name).malloc_trim
  except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl), or no libc found
    return False
  trim(0)
  return True
