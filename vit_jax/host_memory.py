"""Hands the C heap's freed pages back to the OS once a step is compiled.

Compiling a large step allocates about a gigabyte of small objects in XLA's compiler, and
frees them when done. glibc keeps freed small-object pages in its arenas, while the step's
buffers are large enough to be mmap'd, so they cannot reuse those pages: without a trim,
the process's peak RSS is the compiler's leftovers plus the step (R50+ViT-B/16 b8 f32 on
CPU: 3.03 GiB, 2.51 with the trim; benchmarks/README.md, seventh session).
"""
import ctypes
import ctypes.util


def release_freed():
  """glibc's `malloc_trim(0)`; nothing where the C library has none. Whether it ran."""
  name = ctypes.util.find_library('c')
  try:
    trim = ctypes.CDLL(name).malloc_trim
  except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl), or no libc found
    return False
  trim(0)
  return True
