"""Published checkpoints in and out: .npz files as released, and fine-tuning surgery.

ViT and hybrid files: flat keys are this package's parameter paths joined by '/', except
that hybrid GroupNorm parameters are stored as (1, 1, 1, C). BiT files (BiT-S/BiT-M) use
TF names ('resnet/block1/unit01/a/group_norm/gamma'); the mapping lives here and only
here. Files are read with allow_pickle=False: an object array is refused.
"""
from collections.abc import Mapping
import functools
import glob
import io
import json
import logging as std_logging
import math
import os
import re
import shlex
import tempfile
import time
import zipfile
import zlib

from absl import logging
import flax
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import scipy.ndimage

from vit_jax import errors
from vit_jax import models
from vit_jax import packed_state
from vit_jax import paths
from vit_jax import polyak

# BiT unit sub-layers: TF name prefix -> (our norm, our conv).
_BIT_LAYERS = {'a': ('gn1', 'conv1'), 'b': ('gn2', 'conv2'), 'c': ('gn3', 'conv3')}
_BIT_NORM_PARAMS = {'gamma': 'scale', 'beta': 'bias'}
_GN_NAME = re.compile(r'(^|/)gn(_root|_proj|\d)/(scale|bias)$')


class IncompatibleCheckpointError(ValueError):
  """A readable checkpoint that does not fit the model: what differs, and the likely cause."""


class UnreadableFileError(ValueError):
  """An .npz that cannot be read (missing, not a zip, damaged); `reason` says how."""

  def __init__(self, path, reason, fix):
    super().__init__(f'{path} {reason}: {fix}')
    self.path, self.reason = path, reason


def _unreadable(path, error):
  """The UnreadableFileError of a file that could not be opened or read, or None where
  `error` is not one of reaching it (OSError locally; tf.errors.OpError from gs://, with
  TensorFlow imported only there)."""
  if not isinstance(error, OSError) and not type(error).__module__.startswith('tensorflow'):
    return None
  fix = _missing_file_fix(path) if isinstance(error, FileNotFoundError) else 'check the path'
  if isinstance(error, IsADirectoryError):  # e.g. a run's checkpoints/<step>: orbax's, not .npz
    fix = ("pass an .npz file: the folders under a run's checkpoints/ hold its training state "
           '(vit-evaluate, vit-predict and vit-inspect read one as --workdir RUN --step STEP)')
  if paths.is_remote(path):
    public = re.sub('^gs://', 'https://storage.googleapis.com/', str(path))  # gs:// by curl
    fix = (f'download it (curl -O {public}, or gsutil cp) and pass the local file'
           if public != path else 'download it and pass the local file')
  return UnreadableFileError(path, f'cannot be read ({errors.storage_why(error)})', fix)


def check_reachable(path):
  """Raises the UnreadableFileError that reading `path` would where its metadata cannot be
  read: one request, where a run asks before it makes its workdir (a gs:// file out of reach
  had left a workdir and its log behind), without reading a file a resume does not need."""
  try:
    paths.stat(path)
  except Exception as e:  # pylint: disable=broad-except
    unreadable = _unreadable(path, e)
    if unreadable is None:
      raise
    raise unreadable from None


def _read_npz(path):
  try:
    with paths.open_file(path, 'rb') as f:
      data = io.BytesIO(f.read())
  except Exception as e:  # pylint: disable=broad-except
    unreadable = _unreadable(path, e)
    if unreadable is None:
      raise
    raise unreadable from None
  if not zipfile.is_zipfile(data):
    raise UnreadableFileError(path, 'is not a readable .npz (zip) file',
                              'check the path and download')
  if not zipfile.ZipFile(data).namelist():  # np.load would call it pickled
    raise UnreadableFileError(path, 'holds no arrays', 'check the path and export it again')
  data.seek(0)
  try:
    with np.load(data, allow_pickle=False) as npz:
      arrays = {k: npz[k] for k in npz.files}
  except ValueError as e:
    if 'allow_pickle' in str(e) or 'Object arrays' in str(e):
      raise UnreadableFileError(
          path, 'holds pickled (object) arrays, which are never loaded',
          're-export it with numeric arrays only (e.g. checkpoint.save_npz)') from None
    raise UnreadableFileError(path, f'is not a readable .npz file ({e})',
                              'check the path and download') from None
  except (zipfile.BadZipFile, EOFError, OSError, zlib.error) as e:  # damaged after writing
    raise UnreadableFileError(path, f'is damaged ({errors.one_line(e)})',
                              'download or export it again') from None
  # Parameters are floating-point numbers: anything else would be cast silently (or fail
  # deep in the caller), and a NaN would surface only as a diverged first step.
  for key, value in arrays.items():
    if not isinstance(value, np.ndarray):  # a zip member that is no .npy: np.load's bytes
      raise UnreadableFileError(path, f'holds {key}, which is not an array',
                                'check the path and download or export it again')
    if value.dtype.kind != 'f':
      raise UnreadableFileError(path, f'holds {key} as {value.dtype}, not floating-point',
                                're-export it with float arrays (e.g. checkpoint.save_npz)')
    if not np.isfinite(value).all():
      raise UnreadableFileError(
          path, f'holds NaN or infinite values in {key}',
          'it is damaged or from a diverged run: download or export it '
          'again')
  return arrays


def _missing_file_fix(path):
  """The fix for a local .npz that is not there: where its name is a published file's
  (ViT-B_16.npz, BiT-M-R50x1.npz), the command that downloads it."""
  # pylint: disable-next=g-import-not-at-top  (the table of published files, on this failure only)
  from vit_jax.configs import finetune
  stem = os.path.basename(str(path))[:-len('.npz')] if str(path).endswith('.npz') else ''
  model = stem[len('BiT-M-'):] if stem.startswith('BiT-M-') else stem
  if model not in finetune.MODELS or ('ViT-' in model) == stem.startswith('BiT-M-'):
    return 'check the path, or download the file (README: "Published checkpoints")'
  public = finetune.pretrained_path(model).replace('gs://', 'https://storage.googleapis.com/')
  return f'check the path, or download it: curl -O {public}'


def _is_bit(flat):
  return any(k.startswith('resnet/') for k in flat)


def _bit_key_to_ours(key):
  """'resnet/block1/unit01/a/group_norm/gamma' -> 'block1/unit01/gn1/scale'."""
  parts = key.split('/')[1:]  # drop 'resnet'
  if parts[:2] == ['root_block', 'standardized_conv2d']:
    return 'conv_root/' + parts[2]
  if parts[0] == 'group_norm':
    return 'norm/' + _BIT_NORM_PARAMS[parts[1]]
  if parts[:2] == ['head', 'conv2d']:
    return 'head/' + parts[2]
  block, unit, layer, *rest = parts
  norm, conv = _BIT_LAYERS[layer]
  if rest[0] == 'proj':
    return f'{block}/{unit}/conv_proj/kernel'
  if rest[0] == 'group_norm':
    return f'{block}/{unit}/{norm}/{_BIT_NORM_PARAMS[rest[1]]}'
  return f'{block}/{unit}/{conv}/kernel'


def _bit_key_to_file(key):
  """Inverse of _bit_key_to_ours."""
  parts = key.split('/')
  if parts[0] == 'conv_root':
    return 'resnet/root_block/standardized_conv2d/kernel'
  if parts[0] == 'norm':
    return 'resnet/group_norm/' + {'scale': 'gamma', 'bias': 'beta'}[parts[1]]
  if parts[0] == 'head':
    return 'resnet/head/conv2d/' + parts[1]
  block, unit, layer, name = parts
  if layer == 'conv_proj':
    return f'resnet/{block}/{unit}/a/proj/standardized_conv2d/kernel'
  tf_layer = {v: k for k, pair in _BIT_LAYERS.items() for v in pair}[layer]
  if layer.startswith('gn'):
    return f'resnet/{block}/{unit}/{tf_layer}/group_norm/' + {
        'scale': 'gamma',
        'bias': 'beta'
    }[name]
  return f'resnet/{block}/{unit}/{tf_layer}/standardized_conv2d/kernel'


def load_npz(path):
  """Reads a published-format .npz (ViT, hybrid or BiT) into the tree `apply` takes."""
  flat = _read_npz(path)
  if not flat:
    raise ValueError(f'{path} holds no arrays: check the file')
  out = {}
  if _is_bit(flat):
    for key, value in flat.items():
      ours = _bit_key_to_ours(key)
      if ours.endswith(('scale', 'bias')) and not ours.startswith('head'):
        value = value.reshape(-1)
      elif ours == 'head/kernel':
        value = value.reshape(value.shape[-2:])  # 1x1 conv -> Dense
      out[ours] = value
  else:
    for key, value in flat.items():
      if _GN_NAME.search(key):
        value = value.reshape(-1)  # hybrid GroupNorm params are stored as (1, 1, 1, C)
      out[key] = value
  _check_kernels_fit_biases(path, out)
  return flax.traverse_util.unflatten_dict(out, sep='/')


def _check_kernels_fit_biases(path, flat):
  """Refuses a layer whose kernel and bias disagree on its output size.

  The head's size is read from its kernel: without this a damaged or spliced file would
  blame its bias (the array that is right) against a model built from the kernel.
  """
  for key, bias in flat.items():
    kernel = flat.get(key[:-len('bias')] + 'kernel') if key.endswith('/bias') else None
    if kernel is not None and kernel.shape[kernel.ndim - bias.ndim:] != bias.shape:
      raise UnreadableFileError(
          path, f'holds {key[:-len("bias")]}kernel {kernel.shape} and {key} {bias.shape}, '
          'which disagree on the layer\'s size', 'it is damaged or pieced together from two '
          'files: download or export it again')


def save_npz(path, params):
  """Writes `params` in the published layout (readable by timm and other loaders).

  The write goes to a temporary file renamed into place: a crash never leaves a
  truncated file where a good one was. `params` may also be what model.init returns,
  {'params': ...}. Arrays are written in float32, as the published files hold them: a
  bfloat16 array had been written as 2-byte void records that no loader reads (float16
  and bfloat16 widen exactly; float64 is rounded).
  """
  if isinstance(params, Mapping) and 'params' in params:  # flax's variables
    others = [k for k in params if k != 'params']
    if others:
      raise ValueError(f'save_npz writes a model\'s parameters; these variables also hold '
                       f'{", ".join(map(repr, others))}: pass variables[\'params\']')
    params = params['params']
  flat = flax.traverse_util.flatten_dict(jax.device_get(params), sep='/')
  is_vit = 'embedding/kernel' in flat
  out = {}
  for key, value in flat.items():
    value = _published_array(key, value)
    if is_vit:
      if _GN_NAME.search(key):
        value = value.reshape(1, 1, 1, -1)
      out[key] = value
    else:
      if key == 'head/kernel':
        value = value.reshape(1, 1, *value.shape)
      try:
        out[_bit_key_to_file(key)] = value
      except (KeyError, ValueError):
        raise ValueError(f'save_npz: {key!r} is a parameter of neither a ViT (no '
                         "'embedding/kernel') nor a BiT ResNet: pass the parameters of a "
                         'vit_jax.models model') from None
  if paths.is_remote(path):  # object stores replace whole objects: no partial file to fear
    buf = io.BytesIO()
    np.savez(buf, **out)
    with paths.open_file(path, 'wb') as f:
      f.write(buf.getvalue())
    return
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  for stale in glob.glob(glob.escape(os.path.abspath(path)) + '.*.tmp'):  # a write killed
    os.remove(stale)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + '.', suffix='.tmp')
  try:
    with os.fdopen(fd, 'wb') as f:
      np.savez(f, **out)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a published file follows the umask
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


def _published_array(key, value):
  """`value` as a float32 numpy array (the published files' dtype); a non-float is refused."""
  value = np.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise ValueError(f'save_npz: {key} is {value.dtype}, not a float array: pass the '
                     "model's parameters (model.init(...)['params'] or a loaded checkpoint)")
  return value.astype(np.float32)


def _umask():
  mask = os.umask(0o22)
  os.umask(mask)
  return mask


def interpolate_posemb(posemb, num_tokens, has_class_token):
  """Resizes (1, N, D) position embeddings to `num_tokens` by 2D bilinear interpolation.

  The class token's embedding is kept; the sqrt(N) x sqrt(N) grid is zoomed as
  scipy.ndimage.zoom(order=1) does, which is how the published fine-tuning code does it.
  """
  posemb = np.asarray(posemb)
  extra = 1 if has_class_token else 0
  tok, grid = posemb[:, :extra], posemb[0, extra:]
  gs_old, gs_new = int(np.sqrt(len(grid))), int(np.sqrt(num_tokens - extra))
  if gs_old**2 != len(grid) or gs_new**2 != num_tokens - extra:
    raise ValueError(
        f'pos_embedding: {len(grid)} -> {num_tokens - extra} grid tokens are not square '
        'grids: use square images')
  grid = grid.reshape(gs_old, gs_old, -1)
  grid = scipy.ndimage.zoom(grid, (gs_new / gs_old, gs_new / gs_old, 1), order=1)
  return np.concatenate([tok, grid.reshape(1, gs_new * gs_new, -1)], axis=1)


def _target_shapes(model, image_size):
  images = jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32)
  variables = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x, train=False), images)
  return flax.traverse_util.flatten_dict(variables['params'], sep='/')


def _and_more(keys):
  """'first' or 'first (and N more)' of a list of parameter names."""
  return keys[0] + (f' (and {len(keys) - 1} more)' if len(keys) > 1 else '')


def _encoder_blocks(keys):
  return len({k.split('/')[1] for k in keys if k.startswith('Transformer/encoderblock_')})


def _depth_mismatch(flat, target):
  """Where the checkpoint and the model differ in their number of encoder blocks: what to
  say (the generic hint of another architecture did not name the depth); else None."""
  have, want = _encoder_blocks(flat), _encoder_blocks(target)
  if have and want and have != want:
    blocks = lambda n: errors.count_of(n, 'encoder block')
    return (f'the checkpoint has {blocks(have)} where the model has {blocks(want)}: pick the '
            f'model matching the file, with num_layers={have}')
  return None


def load_pretrained(path_or_params, model, num_classes, image_size, *, reset_head=True,
                    head_bias_init=0.0):
  """Adapts a pre-trained checkpoint to `model` for fine-tuning; returns the params.

  - a pre-logits layer the model does not have is dropped (build the model with
    `representation_size` to keep it);
  - the head is replaced by zeros for `num_classes` (bias `head_bias_init`) when
    `reset_head` or when its size differs;
  - position embeddings are interpolated to the grid of `image_size`, class token kept.
  Logs one line saying what changed. Any other mismatch raises IncompatibleCheckpointError
  naming the key, both shapes and the likely cause.
  """
  params = load_npz(path_or_params) if isinstance(path_or_params,
                                                  (str, os.PathLike)) else path_or_params
  flat = {
      k: np.asarray(v)
      for k, v in flax.traverse_util.flatten_dict(jax.device_get(params), sep='/').items()
  }
  model = model.clone(num_classes=num_classes)
  target = _target_shapes(model, image_size)
  changes = []
  out = {}

  dropped = sorted(k for k in flat if k not in target)
  # Layers only pre-training uses (masked_patch_head, mask_embedding: masked_patches.py).
  droppable = ('pre_logits', 'head', 'masked_patch_head', 'mask_embedding')
  unexpected = [k for k in dropped if k.split('/')[0] not in droppable]
  depth = _depth_mismatch(flat, target)
  if unexpected:
    raise IncompatibleCheckpointError(
        f'Checkpoint key {_and_more(unexpected)} has no place in the model: '
        + (depth or 'the checkpoint is of another architecture; pick the model name matching '
           'the file'))
  changes += [
      f'{name} dropped' for name in droppable if any(k.split('/')[0] == name for k in dropped)
  ]
  missing = [k for k in target if k not in flat and not k.startswith('head/')]
  if missing:
    raise IncompatibleCheckpointError(
        f'Model parameter {_and_more(missing)} is not in the checkpoint: '
        + (depth or 'the checkpoint is of another architecture (e.g. classifier token vs gap, '
           'representation_size); pick the model matching the file'))

  for key, spec in target.items():
    if key.startswith('head/'):
      old = flat.get(key)
      if reset_head or old is None or old.shape != spec.shape:
        out[key] = (np.zeros(spec.shape, np.float32) if key.endswith('kernel') else np.full(
            spec.shape, head_bias_init, np.float32))
        continue
      out[key] = old
      continue
    value = flat[key]
    if key.endswith('pos_embedding') and value.shape != spec.shape:
      if value.shape[-1] != spec.shape[-1]:
        raise IncompatibleCheckpointError(
            f'{key}: checkpoint {value.shape} vs model {spec.shape}: hidden sizes '
            'differ; pick the model variant matching the file')
      has_cls = 'cls' in target
      try:
        value = interpolate_posemb(value, spec.shape[1], has_cls)
      except ValueError as e:
        raise IncompatibleCheckpointError(str(e)) from None
      g0 = int(np.sqrt(flat[key].shape[1] - has_cls))
      g1 = int(np.sqrt(spec.shape[1] - has_cls))
      changes.append(f'pos_embedding {g0}x{g0} -> {g1}x{g1} grid')
    elif (key == 'embedding/kernel' and value.ndim == len(spec.shape) == 4
          and value.shape[:2] != spec.shape[:2]):  # the same name, another patch_size
      p, q = value.shape[:2], spec.shape[:2]
      raise IncompatibleCheckpointError(
          f'{key}: checkpoint {value.shape} vs model {spec.shape}: the file\'s patches are '
          f'{p[0]}x{p[1]}, the model\'s {q[0]}x{q[1]}: set the model\'s patch_size to {p[0]} '
          f'(vit-train: --config.model.patch_size={p[0]})')
    elif value.shape != spec.shape:
      cause = ('patch size or hidden size differs'
               if key.startswith('embedding') else 'a different model variant')
      raise IncompatibleCheckpointError(
          f'{key}: checkpoint {value.shape} vs model {spec.shape}: {cause}; '
          'pick the model matching the file')
    out[key] = value.astype(spec.dtype)

  old_head = flat.get('head/kernel')
  new_head = target.get('head/kernel')
  if new_head is not None and (reset_head or old_head is None or old_head.shape != new_head.shape):
    old_k = old_head.shape[-1] if old_head is not None else 'no'
    changes.insert(0, f'head {old_k} -> {num_classes} classes (zeros, bias {head_bias_init:g})')
  if changes:  # (not "nothing changed": a line above vit-evaluate's one-line errors)
    logging.info('load_pretrained: %s', '; '.join(changes))
  return flax.traverse_util.unflatten_dict(out, sep='/')


def file_image_size(flat, model_name, **overrides):
  """The resolution a ViT checkpoint was trained at: its position embeddings' grid side
  times the pixels one token covers (a fine-tuned ImageNet file: 384); None where the file
  has no position embeddings (a ResNet) or they are no square grid."""
  posemb = flat.get('Transformer/posembed_input/pos_embedding')
  if posemb is None or posemb.ndim != 3:
    return None
  tokens = posemb.shape[1] - (1 if 'cls' in flat else 0)
  side = math.isqrt(max(tokens, 0))
  if side < 1 or side * side != tokens:
    return None
  return side * models.pixels_per_token(models.get_variant(model_name, **overrides))


def load_model(path, model_name, image_size=None, **overrides):
  """(model, params) for a published-format .npz, head and pre-logits as in the file.

  The head size (0 without a head) and representation_size are read from the file;
  position embeddings are interpolated to `image_size` (None: the file's own resolution,
  file_image_size, else 224).
  """
  params = load_npz(path)
  flat = flax.traverse_util.flatten_dict(params, sep='/')
  if image_size is None:
    image_size = file_image_size(flat, model_name, **overrides) or 224
  for have, lack in (('head/kernel', 'head/bias'), ('head/bias', 'head/kernel')):
    if have in flat and lack not in flat:  # its head is used as it is: zeros would stand in
      raise UnreadableFileError(path, f'holds {have} but no {lack}',
                                'it is damaged: download or export it again')
  num_classes = flat['head/kernel'].shape[-1] if 'head/kernel' in flat else 0
  if 'pre_logits/kernel' in flat and 'representation_size' not in overrides:
    overrides['representation_size'] = int(flat['pre_logits/kernel'].shape[-1])
  model = models.get_model(model_name, num_classes, **overrides)
  params = load_pretrained(params, model, num_classes, image_size, reset_head=False)
  return model, params


def _training_now(workdir):
  """The holder of the workdir's lock while its run trains, else None; TensorFlow (which
  rundir imports) is not imported for the workdirs of runs that have ended."""
  if paths.is_remote(workdir) or not os.path.exists(os.path.join(workdir, 'lock')):
    return None
  # pylint: disable=g-import-not-at-top  (TensorFlow: only while a lock is there)
  from vit_jax import tensorflow_quietly  # noqa: F401  (first: the commands' stderr stays theirs)
  from vit_jax import rundir
  # pylint: enable=g-import-not-at-top
  return rundir.WorkdirLock(workdir).training_now()


def _runs_near(folder):
  """Where a local folder without config.json is a run's checkpoints/ or holds runs (a
  vit-sweep's DIR, a vit-vtab's): which --workdir to pass instead, else ''."""
  if paths.is_remote(folder):
    return ''
  parent = os.path.dirname(folder)
  if os.path.basename(folder) == 'checkpoints' and os.path.exists(
      os.path.join(parent, 'config.json')):
    return (f' (this is the checkpoints folder of {shlex.quote(parent)}: pass that, with --step '
            'N for one of them)')
  try:
    runs = sorted(
        d for d in os.listdir(folder) if os.path.exists(os.path.join(folder, d, 'config.json')))
  except OSError:
    return ''
  if not runs:
    return ''
  named = ', '.join(shlex.quote(os.path.join(folder, d)) for d in runs[:3])
  named += ', ...' if len(runs) > 3 else ''
  return f' (this folder holds {errors.count_of(len(runs), "run")} in its folders: {named})'


def load_run(workdir, step=None):
  """(config, model, params) of a finished `vit-train` run: its config.json and final.npz;
  with `step`, of its checkpoint of that step instead (a run part-way, or still training),
  the parameters as the run evaluates them (the Polyak average where it keeps one)."""
  workdir = paths.resolve(workdir)
  config_path = os.path.join(workdir, 'config.json')
  final_path = os.path.join(workdir, 'final.npz')
  rerun = 'run vit-train again with the same --workdir'
  live = _training_now(workdir)
  if live and step is None and not paths.exists(final_path):
    raise ValueError(f'{workdir} has no final.npz yet: a run is training there now ({live}): '
                     'wait for it to end (its train.INFO shows how far it is), or read one of '
                     'its checkpoints with --step N')
  if live and step is None:
    logging.warning(
        '%s is being trained now (%s): its final.npz is of the run before, until '
        'this one writes its own', workdir, live)
  try:
    with paths.open_file(config_path, 'r') as f:
      config = ml_collections.ConfigDict(json.load(f))
  except (OSError, IOError) as e:
    if isinstance(e, PermissionError):  # not 'has no config.json'
      raise ValueError(f'{config_path} cannot be read (permission denied): give this user read '
                       'permission on the run\'s folder') from None
    if paths.exists(workdir) and not paths.is_remote(workdir) and not os.path.isdir(workdir):
      raise ValueError(f'{workdir} is a file: pass the --workdir (a folder) of a vit-train '
                       'run') from None
    if not paths.exists(workdir):  # a typo, as a rule: not a run that lost its config
      raise ValueError(f'{workdir} does not exist: pass the --workdir of a vit-train run') from None
    if paths.exists(final_path):  # the run's file, without the config that says its model
      raise ValueError(
          f'{workdir} has a final.npz but no config.json: run its vit-train command again with '
          "--config.resume_changes='*' to write it again, or pass "
          f'--checkpoint={shlex.quote(final_path)} with its --model (and --model_overrides)'
      ) from None
    raise ValueError(f'{workdir} has no config.json: pass the --workdir of a vit-train '
                     f'run{_runs_near(workdir)}') from None
  except ValueError as e:
    raise ValueError(f'{config_path} is damaged ({errors.one_line(e)}): restore it, or run the '
                     'run\'s vit-train command again with --config.resume_changes=\'*\' to write '
                     'it again') from None
  if step is not None:
    final_path = os.path.join(workdir, 'checkpoints', str(step))  # (named in the errors below)
    params = _evaluated_params(workdir, step, config)
  elif not paths.exists(final_path):
    raise ValueError(f'{workdir} has no final.npz: its run stopped before the end (the end of '
                     f'its train.INFO says where); {rerun} to finish it, or read one of its '
                     'checkpoints with --step N') from None
  else:
    try:
      params = load_npz(final_path)
    except UnreadableFileError as e:
      raise ValueError(f'{final_path} {e.reason}: {rerun} to write it again from the last '
                       'checkpoint') from None
  flat = flax.traverse_util.flatten_dict(params, sep='/')
  num_classes = flat['head/kernel'].shape[-1] if 'head/kernel' in flat else 0
  try:
    model = models.from_config(config, num_classes)
    image_size = config.image_size
  except AttributeError as e:  # edited, or written by a version without the field
    if not isinstance(e.obj, ml_collections.ConfigDict):
      raise
    raise ValueError(f'{config_path} has no field {e.name!r} (edited, or written by another '
                     'version): restore it, or run the run\'s vit-train command again with '
                     '--config.resume_changes=\'*\' to write it again') from None
  except ValueError as e:  # a model field this version does not know (a newer one's run)
    raise ValueError(f'{config_path} names a model this version of vit_jax cannot build ({e}): '
                     'read it with the version of vit_jax that wrote it (a newer one?), or '
                     'restore the file if it was edited') from None
  # A final.npz of another run or model copied in, or one edited: one line, not flax's
  # ScopeParamShapeError traceback at the first forward pass.
  for key, spec in _target_shapes(model, image_size).items():
    shape = flat[key].shape if key in flat else 'missing'
    if shape != spec.shape:
      raise ValueError(f'{final_path} does not fit the model of its run\'s config.json ({key}: '
                       f'file {shape} vs model {spec.shape}): {rerun} to write it again from '
                       'the last checkpoint, or pass the file as --checkpoint with its --model')
  return config, model, jax.tree.map(jnp.asarray, params)


def _evaluated_params(workdir, step, config):
  """The parameters a run evaluates at its checkpoint of `step` (saved_arrays): its Polyak
  average where config.polyak_decay keeps one, as final.npz holds at the end."""
  arrays = saved_arrays(os.path.join(workdir, 'checkpoints'), step)

  def tree(prefix):
    return flax.traverse_util.unflatten_dict(
        {
            k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)
        }, sep='/')

  params = tree('params/')
  if polyak.enabled(config):
    params = polyak.averaged({
        'sum': tree('polyak/sum/'),
        'weight': arrays['polyak/weight']
    }, params, xp=np)
  return jax.tree.map(lambda x: np.asarray(x, np.float32), params)


# Training state: orbax, asynchronous, written collectively by all hosts.


class DifferentModelError(ValueError):
  """The checkpoints in a directory do not fit the model (another model's workdir)."""


def _save_each_replicated_array_from_one_replica():
  """Turns off orbax's replica-parallel saving in this process (what is saved is the same).

  By default orbax splits an array that several devices hold among them, so that each copies
  its part to the host. CPU devices share the host's memory: there is nothing to copy in
  parallel, and the split only adds a compiled slice per array shape at the first save (a
  30-step CLI run on 8 CPU devices: 36 s of CPU with it, 28 s without, measured). orbax
  0.12 reads the choice from its default jax.Array handler and offers no public setter.
  """
  ocp.type_handlers.get_type_handler(jax.Array)._use_replica_parallel = False  # pylint: disable=protected-access


def _remove_unfinished_saves(directory):
  """Removes the temporary directories of saves cut short (kill -9, a lost host) from the
  checkpoints folder `directory`; they are never taken for a checkpoint.

  Here, before the manager is made, not by orbax's cleanup_tmp_directories: that runs in a
  background thread, and a run stopped just after the manager was made (SIGTERM during
  set-up) exited while the thread went on, whose error then came after the run's last
  line. Process 0 removes them, as orbax does.
  """
  if jax.process_index() != 0:
    return
  for unfinished in ocp.path.step.all_temporary_paths(directory):
    logging.info('Removing %s: a save that did not finish', unfinished.get())
    unfinished.get().rmtree()


def train_state_manager(directory, keep):
  """An orbax manager for `directory` that keeps the last `keep` steps (-1: all).

  Saves are asynchronous (the loop goes on while files are written) and atomic: a
  step directory appears under its final name only once complete, so a run killed
  mid-save resumes from the previous complete step.
  """
  _remove_unfinished_saves(directory)
  _drop_unreadable_metadata_notices()
  options = ocp.CheckpointManagerOptions(max_to_keep=None if keep == -1 else keep, create=True)
  if jax.devices()[0].platform == 'cpu':
    _save_each_replicated_array_from_one_replica()
  manager = ocp.CheckpointManager(directory, options=options,
                                  item_handlers=ocp.StandardCheckpointHandler())
  _check_writable(directory)
  return manager


def _check_writable(directory):
  """Raises OSError where this user cannot make a file in local `directory`. A checkpoints
  folder the run could not write (another user's, or mounted read-only) had failed only at
  the first save, after training up to it; orbax's save threads then waited on the save
  that never started, for minutes, and the process did not exit."""
  if paths.is_remote(directory):
    return  # a bucket's permissions are the workdir's, which the run's lock has tried
  fd, probe = tempfile.mkstemp(dir=directory, prefix='.vit_jax_write_check.')
  os.close(fd)
  os.unlink(probe)


# orbax restores whatever bytes are on disk: a flipped bit comes back as a wrong weight, and
# a damaged checkpoint would go on training or be exported as final.npz. Each save stores
# two wrapping uint32 sums per array in the step's metadata; a restore recomputes them.
_CHECKSUMS = 'vit_jax_checksums'


def _words(x):
  """The array's bits as a flat uint32 vector (8- and 16-bit items widened)."""
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()


def _leaf_sums(x):
  # Integer sums wrap exactly, so the result is the same on any mesh and reduction order;
  # the odd weights catch values that moved as well as values that changed.
  words = _words(x)
  weights = 2 * jnp.arange(words.size, dtype=jnp.uint32) + 1
  return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * weights, dtype=jnp.uint32)])


@functools.lru_cache(maxsize=None)
def _leaf_sums_on(mesh):
  """The jitted sums of one array, replicated on `mesh` (None: where the array is).

  One program per array shape, not one for the whole state: a state's program grows with
  its arrays (3.5 s to compile for ViT-Ti/16's parameters and momentum on CPU), while the
  arrays of a model's repeated blocks share a few shapes, each compiled once."""
  out = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.jit(_leaf_sums, out_shardings=out)


_HOST_CHUNK = 1 << 20  # words per NumPy pass of _host_sums: 4 MiB temporaries at most


def _in_host_memory(x):
  """Whether every shard of `x` is in this process's memory: CPU devices, this host's."""
  return (isinstance(x, jax.Array) and x.is_fully_addressable and x.dtype.itemsize <= 4
          and all(d.platform == 'cpu' for d in x.sharding.device_set))


@functools.lru_cache(maxsize=1)
def _odd_weights(n):
  return np.arange(n, dtype=np.uint32) * np.uint32(2) + np.uint32(1)


def _host_sums(x):
  """_leaf_sums in NumPy (the same wrapping uint32 arithmetic, so the same two numbers):
  no program to compile. On the CPU the programs cost more than the sums: 13 array shapes
  took 2.4 s to compile in a 6-step quickstart run, at its first save and again at resume.
  ViT-B/16's parameters and momentum: 0.34-0.46 s here; the programs 2.9 s the first time,
  0.43-0.49 s after (benchmarks/README.md, thirty-eighth session)."""
  words = np.asarray(x).reshape(-1)
  words = words.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[words.dtype.itemsize])
  weights = _odd_weights(_HOST_CHUNK)
  total = weighted = 0
  for start in range(0, words.size, _HOST_CHUNK):
    chunk = words[start:start + _HOST_CHUNK].astype(np.uint32, copy=False)
    chunk_sum = int(chunk.sum(dtype=np.uint32))
    total += chunk_sum
    # Word start+i weighs 2(start+i)+1: the first chunk's weight of i, plus 2*start.
    weighted += int((chunk * weights[:chunk.size]).sum(dtype=np.uint32)) + 2 * start * chunk_sum
  return [total % 2**32, weighted % 2**32]


def state_checksums(state, host=True):
  """{array path: [sum, weighted sum]} of a train state's arrays (global arrays, any mesh).

  host: arrays whose shards are all in this process's memory are summed with NumPy; the
  others (on accelerators, or spread over hosts) by a program on their devices. False: every
  array on its devices.
  """
  mesh = next((x.sharding.mesh for x in jax.tree.leaves(state)
               if isinstance(getattr(x, 'sharding', None), jax.sharding.NamedSharding)), None)
  sums_of = _leaf_sums_on(mesh)
  leaves = jax.tree_util.tree_leaves_with_path(state)
  on_host = [host and _in_host_memory(x) for _, x in leaves]
  # Dispatched first, fetched in one transfer after the host's sums.
  dispatched = [None if here else sums_of(x) for (_, x), here in zip(leaves, on_host)]
  sums = [_host_sums(x) if here else None for (_, x), here in zip(leaves, on_host)]
  sums = [mine or theirs for mine, theirs in zip(sums, jax.device_get(dispatched))]
  return {
      packed_state.leaf_path(path): [int(v) for v in value]
      for (path, _), value in zip(leaves, sums)
  }


# Where each array of the state is in the saved tree (vit_jax/packed_state.py); checkpoints
# written before it hold the state's own tree.
_LAYOUT = 'vit_jax_layout'
_CORE_HOURS = 'core_hours'  # the run's device-hours up to the save, over its resumptions


def save_train_state(manager, step, state, force=False, core_hours=None):
  tree, layout = packed_state.pack(state)
  metadata = {_CHECKSUMS: state_checksums(state), _LAYOUT: layout}
  if core_hours is not None:
    metadata[_CORE_HOURS] = float(core_hours)
  return manager.save(step, args=ocp.args.StandardSave(tree), force=force, custom_metadata=metadata)


def saved_core_hours(manager, step):
  """The core-hours the run had spent when it saved `step` (0.0 for a checkpoint saved
  before they were kept)."""
  return float(_custom_metadata(manager, step).get(_CORE_HOURS, 0.0))


def _custom_metadata(manager, step):
  return manager.metadata(step).custom_metadata or {}


def _check_sums(custom_metadata, state):
  """Raises ValueError naming the first array whose bits differ from those saved with it in
  a step's `custom_metadata` (checkpoints written before checksums were kept pass)."""
  saved = custom_metadata.get(_CHECKSUMS)
  if not saved:
    return
  restored = state_checksums(state)
  for key in sorted(set(saved) | set(restored)):
    if saved.get(key) != restored.get(key):
      raise ValueError(f'{key} does not match the checksum saved with it (damaged files)')


def _flat_shapes(tree):
  return {
      '/'.join(re.findall(r"\['?([^'\]]+)'?\]", jax.tree_util.keystr(k))): tuple(v.shape)
      for k, v in jax.tree_util.tree_leaves_with_path(tree)
  }


def _shapes_by_path(tree):
  return {
      packed_state.leaf_path(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(tree)
  }


def check_fits(manager, step, abstract_state, custom_metadata):
  """Raises DifferentModelError if step's saved shapes differ from `abstract_state`'s.
  `custom_metadata` is the step's (_custom_metadata).

  Returns False when the step's metadata cannot be read (a damaged checkpoint).
  """
  layout = custom_metadata.get(_LAYOUT)
  try:
    if layout is not None:
      saved = packed_state.shapes(layout)
    else:  # written before the layout: orbax's tree of the state, whose key style differs
      tree = dict(manager.item_metadata(step))
      if 'params' not in tree:  # packed, and its layout lost with the step's metadata file
        return False
      saved = _flat_shapes(tree)
  except Exception:  # pylint: disable=broad-except  (any damage: the caller falls back)
    return False
  if layout is not None and layout.get('version') != packed_state.VERSION:
    raise DifferentModelError(f'they were written by another version of vit_jax (layout '
                              f'{layout.get("version")!r}, this one reads {packed_state.VERSION})')
  wanted = _shapes_by_path(abstract_state) if layout is not None else _flat_shapes(abstract_state)
  saved_params = {k: v for k, v in saved.items() if k.startswith('params/')}
  for key, shape in wanted.items():
    if key in saved_params and saved_params[key] != shape:
      raise DifferentModelError(f'{key}: checkpoint {saved_params[key]} vs model {shape}')
  only = sorted(set(saved_params) ^ {k for k in wanted if k.startswith('params/')})
  if only:
    raise DifferentModelError(f'{only[0]} is only in the '
                              f'{"checkpoint" if only[0] in saved else "model"}')
  if layout is not None:
    differs = saved != wanted
  else:
    shapes = lambda tree: sorted(tuple(x.shape) for x in jax.tree.leaves(tree))
    differs = shapes(dict(manager.item_metadata(step))) != shapes(abstract_state)
  if differs:
    raise DifferentModelError('the optimizer state differs (another optimizer?)')
  return True


def move_aside(directory, step):
  """Renames checkpoint `step` to `<step>.corrupt-<time>` (never deletes); returns the new path."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top  (local or gs://)
  src = os.path.join(directory, str(step))
  dst = f'{src}.corrupt-{time.strftime("%Y%m%d-%H%M%S")}'
  tf.io.gfile.rename(src, dst)
  return dst


def raise_if_denied(folder):
  """Raises the PermissionError (its filename set) of the first file or folder under a local
  `folder` this user may not read: a step written by another user under a strict umask is
  not damaged, and had been moved aside as such (vit-train) or called damaged (--step N),
  after orbax's 'Event loop is closed' traceback."""
  if paths.is_remote(folder):
    return
  denied = []
  for root, _, files in os.walk(folder, onerror=denied.append):
    for name in files:
      try:
        with open(os.path.join(root, name), 'rb'):
          pass
      except PermissionError as e:
        raise e from None
  for error in denied:
    if isinstance(error, PermissionError):
      raise error


def restore_train_state(manager, abstract_state, *, move_bad=True):
  """The newest restorable state, laid out as `abstract_state` (ShapeDtypeStructs with
  shardings, so it restores onto any mesh), or None when there is none.

  A damaged step (truncated files, missing metadata, arrays whose checksums differ from
  those saved with them) is moved aside as `<step>.corrupt-<time>` with a one-line
  warning, and the previous step is tried; when none is left, a warning says that the run
  starts again.
  Checkpoints of another model raise DifferentModelError naming a parameter.
  """
  directory = str(manager.directory)
  moved = False
  steps = sorted(manager.all_steps(), reverse=True)
  for step in steps:
    error = None
    raise_if_denied(os.path.join(directory, str(step)))
    try:
      custom_metadata = _custom_metadata(manager, step)  # read once: layout and checksums
    except Exception:  # pylint: disable=broad-except  (any damage: the previous step is tried)
      custom_metadata = None
    if custom_metadata is not None and check_fits(manager, step, abstract_state, custom_metadata):
      try:
        state = _restore(manager, step, abstract_state, custom_metadata.get(_LAYOUT))
        _check_sums(custom_metadata, state)
        if moved:
          manager.reload()
        return state
      except Exception as e:  # pylint: disable=broad-except  (damage of any kind)
        error = _one_line(e)
    else:
      error = 'its metadata is unreadable'
    where = 'left in place'
    if move_bad and jax.process_index() == 0:
      try:
        where = 'moved to ' + move_aside(directory, step)
        moved = True
      except Exception as e:  # pylint: disable=broad-except
        where = f'left in place (cannot rename: {_one_line(e)})'
    logging.warning(
        'Checkpoint of step %d in %s cannot be restored (%s): %s; trying the '
        'previous one', step, directory, error, where)
  if steps:  # (each one returned above, had it been intact)
    logging.warning(
        'No checkpoint in %s can be restored (steps %s are damaged): training starts again '
        'from step 0', directory, ', '.join(map(str, steps)))
  manager.reload()
  return None


def _restore(manager, step, abstract_state, layout):
  if layout is None:  # written before packed_state
    return manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
  target = packed_state.restore_target(layout, abstract_state)
  restored = manager.restore(step, args=ocp.args.StandardRestore(target))
  return packed_state.unpack(restored, layout, abstract_state)


class _UnreadableMetadataNotice(std_logging.Filter):
  """Drops orbax's notices that a step's metadata file is missing or cannot be read or
  parsed: three each, from its threads, a garbled file's whole content in them;
  restore_train_state reports such a step itself, in one line ('its metadata is
  unreadable'), and reading it through saved_arrays fails with the step named."""
  _NOTICES = ('Metadata file does not exist', 'Failed to json parse Metadata file',
              'Failed to read Metadata file')

  def filter(self, record):
    return not ('/orbax/' in record.pathname and record.getMessage().startswith(self._NOTICES))


def _drop_unreadable_metadata_notices():
  absl_logger = std_logging.getLogger('absl')
  if not any(isinstance(f, _UnreadableMetadataNotice) for f in absl_logger.filters):
    absl_logger.addFilter(_UnreadableMetadataNotice())


class _ReadOnlyNotice(std_logging.Filter):
  """Drops orbax's warning that a read-only manager's directory is read only (asked for)."""

  def filter(self, record):
    return not record.getMessage().startswith('Given directory is read only')


def saved_arrays(directory, step=None):
  """{array path: NumPy array} of the train state saved at `step` (None: the latest) in
  `directory` (a run's `checkpoints/`), whatever layout it was written in: for looking into
  a run, e.g. the parameters of an earlier step ('params/Transformer/encoder_norm/scale').
  The checksums are not checked (restore_train_state does)."""
  # Read-only as orbax would set it, so that it warns of nothing it changed.
  options = ocp.CheckpointManagerOptions(read_only=True, save_interval_steps=0, create=False)
  _drop_unreadable_metadata_notices()
  notice = _ReadOnlyNotice()
  std_logging.getLogger('absl').addFilter(notice)
  try:
    manager = ocp.CheckpointManager(paths.resolve(directory), options=options,
                                    item_handlers=ocp.StandardCheckpointHandler())
  finally:
    std_logging.getLogger('absl').removeFilter(notice)
  with manager:
    steps = sorted(manager.all_steps())
    if not steps:
      raise ValueError(f'{directory} holds no checkpoints: pass the checkpoints folder of a '
                       'vit-train run (WORKDIR/checkpoints)')
    step = steps[-1] if step is None else step
    if step not in steps:
      raise ValueError(f'{directory} has no checkpoint of step {step}: pass one of its steps '
                       f'({", ".join(map(str, steps))})')
    raise_if_denied(os.path.join(manager.directory, str(step)))
    try:
      state = _restore_on_host(manager, step)
    except Exception as e:  # pylint: disable=broad-except  (damage of any kind, as orbax says)
      manager.reload()
      if step not in manager.all_steps():  # a live run's keep_checkpoints removed it meanwhile
        raise ValueError(f'{directory}/{step} was removed while it was read (the run keeps its '
                         'newest keep_checkpoints): pass one of its steps '
                         f'({", ".join(map(str, manager.all_steps()))})') from None
      others = ', '.join(str(s) for s in steps if s != step)
      raise ValueError(f'{directory}/{step} cannot be read ({_one_line(e)}): it is damaged; '
                       + (f'pass another of its steps ({others})'
                          if others else 'no other step is there')) from None
  return {
      packed_state.leaf_path(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state)
  }


def _restore_on_host(manager, step):
  """The train state saved at `step`, on the host's CPU, in whichever layout it was written."""
  layout = _custom_metadata(manager, step).get(_LAYOUT)
  host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend='cpu')[0])
  if layout is None:  # written before packed_state: orbax's tree of the state
    tree = dict(manager.item_metadata(step))
    if {'packed', 'arrays'} & set(tree):  # packed_state's, its layout lost with the metadata
      raise ValueError('its metadata is unreadable')
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=host), tree)
    return manager.restore(step, args=ocp.args.StandardRestore(target))
  abstract = packed_state.nest({
      e['path']: jax.ShapeDtypeStruct(tuple(e['shape']), np.dtype(e['dtype']), sharding=host)
      for e in layout['leaves']
  })
  restored = manager.restore(
      step, args=ocp.args.StandardRestore(packed_state.restore_target(layout, abstract)))
  return packed_state.unpack(restored, layout, abstract)


def _one_line(error):
  lines = [l.strip() for l in str(error).splitlines() if l.strip()]
  text = lines[0] if lines else type(error).__name__
  return text if len(text) < 200 else text[:197] + '...'
