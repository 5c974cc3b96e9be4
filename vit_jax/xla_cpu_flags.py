"""XLA:CPU flags that make vit_jax train faster on CPU hosts, per compute dtype; set before
JAX starts.

jaxlib 0.10 sends matmuls to YNNPACK fusions by default. What we measured (side by side,
benchmarks/README.md; `benchmarks/xla_cpu_flags.py` measures it on a host):
- float32: with the YNNPACK dot fusions off (XLA's own Eigen dots), the train step of
  ViT-Ti/16, ViT-B/16 and R50+ViT-B/16 ran 1.09-1.14x faster on one 2-core AVX-512
  host (A), where YNNPACK's dots ran at half their standalone speed inside the step;
  on another of the same kind (B, 2x A's matmul rate) it ran ViT-B/16 at 0.88-0.92x.
  Kept (set VIT_JAX_XLA_CPU_FLAGS=0 on a host like B); a per-host choice is open.
- bfloat16: the models' bf16 x bf16 -> f32 dots (models/precision.py) are fast only in
  YNNPACK (~2x the f32 matmul rate); with the fusions off XLA converts them to f32 dots
  and the step ran at 0.2-0.7x. So a bf16 run gets no flag.
The flags only choose CPU kernels: numerics stay those of the dtype (tests compare both
ways), and TPU/GPU programs are not affected.

`apply(dtype=...)` adds the dtype's flags to XLA_FLAGS unless the user already set them
(any value wins) or opted out with VIT_JAX_XLA_CPU_FLAGS=0. XLA reads XLA_FLAGS once,
when the first backend starts, so call it before the first computation, with the
config's dtype. The flag names exist in the jaxlib versions listed below; with another
jaxlib nothing is added, because XLA aborts on a flag it does not know.
"""
import os
import sys

YNNPACK_OFF = '--xla_cpu_experimental_ynn_fusion_type='
FLAGS_BY_DTYPE = {'float32': (YNNPACK_OFF,), 'bfloat16': ()}
FLAGS = FLAGS_BY_DTYPE['float32']  # every flag that may be added
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


def flags_to_add(xla_flags, jaxlib_version, opt_out=None, dtype='float32'):
  """The flags for `dtype` that `apply` would add to an XLA_FLAGS value of `xla_flags`."""
  if opt_out == '0' or '.'.join(jaxlib_version.split('.')[:2]) not in KNOWN_JAXLIB:
    return []
  present = {f.split('=')[0] for f in xla_flags.split()}
  return [f for f in FLAGS_BY_DTYPE.get(dtype, ()) if f.split('=')[0] not in present]


def pending(environ=None, dtype='float32'):
  """The flags `apply` would add now (none once a JAX backend has started)."""
  environ = os.environ if environ is None else environ
  if environ is os.environ and _backend_started():
    return []
  return flags_to_add(environ.get('XLA_FLAGS', ''), _jaxlib_version(), environ.get(OPT_OUT),
                      dtype)


def apply(environ=None, dtype='float32'):
  """Adds `dtype`'s CPU flags to XLA_FLAGS in `environ` (os.environ); returns what it added.

  Does nothing once a JAX backend has started (XLA would ignore the change).
  """
  environ = os.environ if environ is None else environ
  added = pending(environ, dtype)
  if added:
    current = environ.get('XLA_FLAGS', '')
    environ['XLA_FLAGS'] = ' '.join([current, *added]).strip()
  return added
