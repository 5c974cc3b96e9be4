"""JAX's backend, started or said in one line why not. JAX_PLATFORMS naming a platform this
machine has no runtime for had ended every command in 50-110 lines of chained tracebacks
(the handlers asked JAX for its devices again), the last of them a bare AssertionError for
`cuda`; a TPU that another process holds fails the same way."""
import os
import sys

from vit_jax import errors

# How each of why_not's lines starts (vit-sweep and vit-vtab know a point's failure by it).
CANNOT_START = 'JAX cannot start'
# What each platform's runtime comes with (setup.py's extras).
_INSTALLS = {'tpu': ".[tpu]", 'cuda': ".[cuda12]", 'gpu': ".[cuda12]"}


def why_not():
  """None where JAX's backend starts (or has started), else one line: why not, and the fix."""
  import jax  # pylint: disable=g-import-not-at-top
  try:
    jax.devices()
    return None
  except (RuntimeError, AssertionError) as e:
    error = e
  said = errors.one_line(error) if str(error).strip() else 'its runtime is not installed'
  said = said.replace(" (set JAX_PLATFORMS='' to automatically choose an available backend)", '')
  if 'already in use' in said:  # libtpu: "The TPU is already in use by process with pid N"
    return (f'{CANNOT_START} the TPU ({said}): wait for that process to end, or stop it '
            '(another vit-train on this VM?)')
  platforms = os.environ.get('JAX_PLATFORMS', '')
  if platforms:
    installs = sorted({_INSTALLS[p] for p in platforms.split(',') if p in _INSTALLS})
    install = (f"install its runtime (pip install -c constraints.txt '{installs[0]}') or "
               if len(installs) == 1 else '')
    return (f'{CANNOT_START} the backend JAX_PLATFORMS={platforms} names ({said}): {install}'
            'unset JAX_PLATFORMS to run on what this machine has')
  return f'{CANNOT_START} its backend ({said})'


def exit_if_it_cannot_start(program):
  """Exits 1 with `program`'s one line where JAX's backend cannot start."""
  if message := why_not():
    sys.exit(f'{program}: {message}')
