"""XLA:CPU flags that make vit_jax train faster on CPU hosts; set before JAX starts.

jaxlib 0.10 sends matmuls to YNNPACK fusions by default. Inside our training steps those
dots ran at about half the speed of the same dots in isolation, and XLA's own (Eigen)
dot kernels were faster: with the YNNPACK dot fusions off, the f32 train step of
ViT-Ti/16, ViT-B/16 and R50+ViT-B/16 ran 1.09-1.14x faster side by side on a 2-core
AVX-512 host (benchmarks/README.md; `benchmarks/xla_cpu_flags.py` measures it).
The flags only choose CPU kernels: numerics stay float32 (tests compare both ways), and
TPU/GPU programs are not affected.

`apply()` adds the flags to XLA_FLAGS unless the user already set them (any value wins)
or opted out with VIT_JAX_XLA_CPU_FLAGS=0. XLA reads XLA_FLAGS once, when the first
backend starts, so call it before the first computation. The flag names exist in the
jaxlib versions listed below; with another jaxlib nothing is added, because XLA aborts
on a flag it does not know.
"""
import os
import sys

FLAGS = ('--xla_cpu_experimental_ynn_fusion_type=',)
# jaxlib major.minor versions in which the flags above exist (checked by the tests).
KNOWN_JAXLIB = ('0.10',)
OPT_OUT = 'VIT_JAX_XLA_CPU_FLAGS'


def _jaxlib_version():
  try:
    from jaxlib import version  # pylint: disable=import-outside-toplevel
  except ImportError:
    return ''
  return version.__version__


def _backend_started():
  xla_bridge = sys.modules.get('jax._src.xla_bridge')
  return bool(xla_bridge is not None and getattr(xla_bridge, '_backends', None))


def flags_to_add(xla_flags, jaxlib_version, opt_out=None):
  """The flags of FLAGS that `apply` would add to an XLA_FLAGS value of `xla_flags`."""
  if opt_out == '0' or '.'.join(jaxlib_version.split('.')[:2]) not in KNOWN_JAXLIB:
    return []
  present = {f.split('=')[0] for f in xla_flags.split()}
  return [f for f in FLAGS if f.split('=')[0] not in present]


def apply(environ=None):
  """Adds the CPU flags to XLA_FLAGS in `environ` (os.environ); returns what it added.

  Does nothing once a JAX backend has started (XLA would ignore the change).
  """
  environ = os.environ if environ is None else environ
  if environ is os.environ and _backend_started():
    return []
  current = environ.get('XLA_FLAGS', '')
  added = flags_to_add(current, _jaxlib_version(), environ.get(OPT_OUT))
  if added:
    environ['XLA_FLAGS'] = ' '.join([current, *added]).strip()
  return added
