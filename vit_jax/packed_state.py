"""The train state as its checkpoints hold it: small replicated arrays packed together.

orbax's cost per saved array is mostly Python work that does not shrink with the array,
and on a few CPU cores a save every few steps took it from the steps (ViT-Ti/16's 402
arrays: benchmarks/README.md, sixty-first session). So every array that is fully
replicated and smaller than `PACK_BELOW` elements is copied into one flat host buffer per
dtype ('packed/<dtype>'); the others (large, or split over devices by FSDP) are saved as
themselves under their own path ('arrays/params/...'). The layout (each array's path,
dtype, shape and, if packed, offset) goes into the checkpoint's metadata, and restoring
takes the arrays out again onto any mesh.
"""
import jax
import numpy as np

# Arrays of at least this many elements (1 MiB of float32) are saved as themselves. Packing
# copies an array twice on the caller's thread (into the buffer, then orbax's copy of that),
# which for larger arrays costs more than orbax's work per array saves: ViT-B/16 packed below
# 2^20 took the same CPU a save as below 2^18, with twice as much of it in the call.
PACK_BELOW = 2**18
# The layout's format. checkpoint.check_fits refuses a checkpoint whose layout has another
# (written by another vit_jax), and leaves it in place.
VERSION = 1


def leaf_path(path):
  """The name of a state array in checksums and layouts: 'params/Transformer/.../kernel'."""
  return jax.tree_util.keystr(path, simple=True, separator='/')


def _packable(x):
  if not isinstance(x, jax.Array):
    return np.size(x) < PACK_BELOW
  return x.sharding.is_fully_replicated and x.size < PACK_BELOW


def nest(flat):
  """{'a/b/c': x} -> {'a': {'b': {'c': x}}}: orbax names what it saves by its tree."""
  tree = {}
  for path, x in flat.items():
    *parents, name = path.split('/')
    node = tree
    for key in parents:
      node = node.setdefault(key, {})
    node[name] = x
  return tree


def _pick(tree, path):
  for key in path.split('/'):
    tree = tree[key]
  return tree


def pack(state):
  """(the tree to save, its JSON layout) for a train state of global arrays."""
  leaves = jax.tree_util.tree_leaves_with_path(state)
  layout, sizes, own = [], {}, {}
  for path, x in leaves:
    entry = {'path': leaf_path(path), 'dtype': np.dtype(x.dtype).name, 'shape': list(np.shape(x))}
    if _packable(x):
      entry['offset'] = sizes.get(entry['dtype'], 0)
      sizes[entry['dtype']] = entry['offset'] + int(np.size(x))
    else:
      own[entry['path']] = x
    layout.append(entry)
  # This process's copy of each whole replicated array (every host holds one), all of the
  # transfers from accelerators under way before the first is waited for.
  copies = [(e, x.addressable_data(0) if isinstance(x, jax.Array) else np.asarray(x))
            for e, (_, x) in zip(layout, leaves) if 'offset' in e]
  for _, x in copies:
    if isinstance(x, jax.Array) and x.device.platform != 'cpu':
      x.copy_to_host_async()
  packed = {dtype: np.empty(size, dtype) for dtype, size in sizes.items()}
  for entry, x in copies:
    flat = np.asarray(x).reshape(-1)
    packed[entry['dtype']][entry['offset']:entry['offset'] + flat.size] = flat
  tree = {}
  if packed:
    tree['packed'] = packed
  if own:
    tree['arrays'] = nest(own)
  return tree, {'version': VERSION, 'leaves': layout}


def shapes(layout):
  """{array path: shape} of a layout."""
  return {e['path']: tuple(e['shape']) for e in layout['leaves']}


def _entries(layout, abstract_state):
  """[(abstract leaf, its layout entry)] in the state's order; ValueError (one line) for a
  layout that does not fit `abstract_state`'s arrays."""
  if layout.get('version') != VERSION:
    raise ValueError(f'its layout has version {layout.get("version")!r}, not {VERSION}')
  saved = {e['path']: e for e in layout['leaves']}
  entries = []
  for path, target in jax.tree_util.tree_leaves_with_path(abstract_state):
    entry = saved.get(leaf_path(path))
    if entry is None or tuple(entry['shape']) != tuple(target.shape):
      raise ValueError(f'its layout has no array {leaf_path(path)} of shape {target.shape}')
    entries.append((target, entry))
  return entries


def restore_target(layout, abstract_state):
  """What orbax is asked to restore: the packed buffers into host memory (NumPy), the
  arrays saved as themselves onto `abstract_state`'s shardings."""
  sizes, own = {}, {}
  for target, entry in _entries(layout, abstract_state):
    if 'offset' in entry:
      end = entry['offset'] + int(np.prod(entry['shape'], dtype=np.int64))
      sizes[entry['dtype']] = max(sizes.get(entry['dtype'], 0), end)
    else:
      own[entry['path']] = jax.ShapeDtypeStruct(target.shape, target.dtype,
                                                sharding=target.sharding)
  tree = {}
  if sizes:
    tree['packed'] = {
        dtype: jax.ShapeDtypeStruct((n,), np.dtype(dtype)) for dtype, n in sizes.items()
    }
  if own:
    tree['arrays'] = nest(own)
  return tree


def unpack(restored, layout, abstract_state):
  """The train state, laid out as `abstract_state`, from what orbax restored of
  restore_target(layout, abstract_state)."""
  arrays = []
  for target, entry in _entries(layout, abstract_state):
    if 'offset' not in entry:
      x = _pick(restored['arrays'], entry['path'])
    else:
      size = int(np.prod(entry['shape'], dtype=np.int64))
      host = np.asarray(restored['packed'][entry['dtype']])
      host = host[entry['offset']:entry['offset'] + size].reshape(target.shape)
      host = host.astype(target.dtype, copy=False)  # as orbax casts the others
      x = jax.make_array_from_callback(target.shape, target.sharding,
                                       lambda index, host=host: host[index])
    arrays.append(x)
  return jax.tree.unflatten(jax.tree.structure(abstract_state), arrays)
