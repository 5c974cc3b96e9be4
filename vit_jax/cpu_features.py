"""What the host CPU's instruction set offers a compute dtype, read from /proc/cpuinfo.

No JAX here: vit-train reads it before JAX starts, and the XLA:CPU flags' probe cache
(xla_cpu_flags.host_key) names the CPU by its fields.
"""
CPUINFO = '/proc/cpuinfo'
# Feature flags of bf16 arithmetic: x86's AVX-512 BF16 and AMX BF16, Arm's BF16 extension.
BF16_FEATURES = ('avx512_bf16', 'amx_bf16', 'bf16')


def fields(path=None):
  """The first value of each `name : value` line of /proc/cpuinfo; {} where unreadable."""
  info = {}
  try:
    with open(path or CPUINFO) as f:
      for line in f:
        name, sep, value = line.partition(':')
        if sep:
          info.setdefault(name.strip(), value.strip())
  except OSError:
    pass
  return info


def model(path=None):
  """The CPU as benchmarks/README.md names hosts: its model name, then family, model and
  stepping, e.g. 'AMD EPYC 9B14 25 17 1'; 'unknown cpu' where /proc/cpuinfo says nothing."""
  info = fields(path)
  parts = [info.get(k, '') for k in ('model name', 'cpu family', 'model', 'stepping')]
  return ' '.join(filter(None, parts)) or 'unknown cpu'


def features(path=None):
  """The CPU's feature flags (x86 `flags`, Arm `Features`), or None where none are listed."""
  info = fields(path)
  listed = info.get('flags', info.get('Features'))
  return None if listed is None else set(listed.split())


def bf16_note(dtype, path=None):
  """A one-line warning for a bfloat16 run on a CPU without bf16 arithmetic; '' otherwise
  (also where the CPU's features cannot be read)."""
  if dtype != 'bfloat16':
    return ''
  listed = features(path)
  if listed is None or listed & set(BF16_FEATURES):
    return ''
  names = ', '.join(BF16_FEATURES)
  return (f'dtype bfloat16 on a CPU without bf16 instructions (none of {names} in its '
          'features): XLA computes bf16 as float32 here, so bf16 saves memory but no compute; '
          'where speed matters, compare --config.dtype=float32')
