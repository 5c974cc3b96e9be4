"""The device mesh and how arrays are laid out on it: data parallel or FSDP.

One mesh axis, 'data'. Batches are split over it. Parameters and optimizer state are
replicated (data parallel) or, with `config.fsdp`, each array is split along its largest
dimension that the axis size divides (arrays too small to be worth it stay replicated).

On the CPU backend the devices are JAX's split of the host: `config.cpu_devices` of them
(`split_host_cpu`, before the backend starts). XLA runs each device's program on its own
thread, so ops that run on one thread (the attention's small batched dots) overlap with
the other device's work instead of leaving cores idle (benchmarks/README.md).
"""
import os

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

DATA = 'data'
# Arrays below this many elements stay replicated under FSDP: splitting them saves
# nothing and costs a collective each.
_FSDP_MIN_SIZE = 2**14


def mesh_size(config, devices=None, hosts=None):
  """Devices on the data axis; one-line ValueError naming mesh_data when it cannot be.

  `devices` and `hosts` default to this process's view (jax); a launcher checking a
  config for another machine passes that machine's numbers.
  """
  devices = jax.device_count() if devices is None else devices
  hosts = jax.process_count() if hosts is None else hosts
  n = devices if config.mesh_data == -1 else config.mesh_data
  if n < 1 or n > devices or devices % n:
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    raise ValueError(f'mesh_data {config.mesh_data} does not fit the {devices} devices: set '
                     f'--config.mesh_data to -1 (all) or a divisor of {devices} '
                     f'({", ".join(map(str, divisors))})')
  if n < devices and hosts > 1:
    raise ValueError('mesh_data must be -1 on several hosts: set --config.mesh_data=-1')
  return n


# The XLA flag that sets the CPU backend's device count; like JAX_NUM_CPU_DEVICES, a value
# of the user's own wins over config.cpu_devices.
_CPU_DEVICE_COUNT_FLAG = '--xla_force_host_platform_device_count'


def cpu_devices(config, environ=os.environ):
  """(the CPU device count config.cpu_devices asks for, or None where the environment
  sets it, why): a one-line ValueError for a count no host has."""
  n = config.get('cpu_devices', 1)
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f'cpu_devices {n!r} must be a whole number >= 1: set '
                     '--config.cpu_devices (1: the CPU is one device)')
  if environ.get('JAX_NUM_CPU_DEVICES'):
    return None, f'JAX_NUM_CPU_DEVICES={environ["JAX_NUM_CPU_DEVICES"]} decides, not cpu_devices'
  if _CPU_DEVICE_COUNT_FLAG in environ.get('XLA_FLAGS', ''):
    return None, f'XLA_FLAGS {_CPU_DEVICE_COUNT_FLAG} decides, not cpu_devices'
  return n, f'--config.cpu_devices={n}'


def split_host_cpu(config, environ=os.environ):
  """Makes the CPU backend config.cpu_devices devices (call before JAX starts a backend;
  TPU and GPU runs are unaffected); returns why it has the count it has, for the log."""
  n, why = cpu_devices(config, environ)
  if n is not None and n != 1:  # 1 is JAX's own default
    jax.config.update('jax_num_cpu_devices', n)
  return why


def or_other_cpu_devices(config):
  """The end of an error that the CPU device count is a cause of: ' or
  --config.cpu_devices=1' where config.cpu_devices split this process's CPU into its
  devices, ' or another device count (<the variable> decides ...)' where the environment
  did, else ''."""
  if jax.default_backend() != 'cpu':
    return ''
  n, why = cpu_devices(config)
  if n is None and jax.local_device_count() > 1:
    return f' or another device count ({why})'
  if n and n > 1 and jax.local_device_count() == n:
    return ' or --config.cpu_devices=1'
  return ''


def make_mesh(config):
  """A 1-D mesh over `config.mesh_data` devices (-1: all, in jax.devices() order)."""
  return Mesh(np.array(jax.devices()[:mesh_size(config)]), (DATA,))


def data_sharding(mesh):
  """Leading (batch) dimension split over the data axis."""
  return NamedSharding(mesh, P(DATA))


def replicated(mesh):
  return NamedSharding(mesh, P())


def _fsdp_spec(shape, n):
  if n == 1 or int(np.prod(shape, dtype=np.int64)) < _FSDP_MIN_SIZE:
    return P()
  for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
    if shape[axis] % n == 0:
      spec = [None] * len(shape)
      spec[axis] = DATA
      return P(*spec)
  return P()


def tree_shardings(tree, mesh, fsdp):
  """Shardings for a tree of arrays or ShapeDtypeStructs (params, optimizer state)."""
  n = mesh.shape[DATA]
  if not fsdp:
    return jax.tree.map(lambda _: replicated(mesh), tree)
  return jax.tree.map(lambda x: NamedSharding(mesh, _fsdp_spec(x.shape, n)), tree)
