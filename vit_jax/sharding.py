"""The device mesh and how arrays are laid out on it: data parallel or FSDP.

One mesh axis, 'data'. Batches are split over it. Parameters and optimizer state are
replicated (data parallel) or, with `config.fsdp`, each array is split along its largest
dimension that the axis size divides (arrays too small to be worth it stay replicated).
"""
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
