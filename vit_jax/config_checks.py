"""Start-up checks of a training config: each failure is one ValueError line that names
the field and the fix.

No TensorFlow, and no JAX backend: vit-train runs `validate_before_devices` before either
starts, so a mistyped value is refused in about 2 s, not after TensorFlow's import (~6 s);
vit-sweep and vit-tpu check their points the same way without taking a device.
"""
import copy
import math

from vit_jax import device_peaks
from vit_jax import masked_patches
from vit_jax import models
from vit_jax import optim
from vit_jax import polyak
from vit_jax import sharding
from vit_jax import trace
from vit_jax import vtab

ON_NONFINITE = ('stop', 'skip')
# config.pp's crops (preprocessing.py applies them).
TRAIN_CROPS = ('inception', 'resize')
EVAL_CROPS = ('resize', 'central')


def unknown_crop(name, value, choices):
  return ValueError(f'pp.{name} {value!r} is unknown: set --config.pp.{name} to one of {choices}')


def _validate_pp(config):
  """Start-up checks of config.pp: one-line ValueErrors naming the field and the fix."""
  pp = config.pp
  if pp.train_crop not in TRAIN_CROPS:
    raise unknown_crop('train_crop', pp.train_crop, TRAIN_CROPS)
  if pp.eval_crop not in EVAL_CROPS:
    raise unknown_crop('eval_crop', pp.eval_crop, EVAL_CROPS)
  for name in ('inception_min_area', 'central_crop_fraction'):
    if not 0 < pp[name] <= 1:
      raise ValueError(f'pp.{name} {pp[name]} is a fraction of the image: set '
                       f'--config.pp.{name} to a value in (0, 1]')


def _refuse_non_finite(config, prefix=''):
  """No field holds nan or an infinity (typed as `--config.X=nan`, or a sweep's bad
  arithmetic): a comparison with nan is false, so range checks alone let it through, and
  e.g. `grad_clip_norm > 0` would then turn clipping off without a word."""
  for name, value in config.items():
    if hasattr(value, 'items'):
      _refuse_non_finite(value, f'{prefix}{name}.')
      continue
    many = isinstance(value, (tuple, list))
    if any(isinstance(v, float) and not math.isfinite(v) for v in (value if many else (value,))):
      raise ValueError(f'{prefix}{name} {value!r} is not a finite number: set '
                       f'--config.{prefix}{name} to {"numbers" if many else "a number"}')


def validate_config(config, num_train_examples=None, dataset_classes=None, *, devices=None,
                    hosts=None):
  """Start-up checks; each failure is one line naming the field and the fix. `devices` and
  `hosts`: those of the machine the run is for (default: this process's)."""
  _refuse_non_finite(config)
  # First: a bad mesh is not blamed on the batch size.
  n_dev = sharding.mesh_size(config, devices, hosts)
  sharding.cpu_devices(config)  # a count no host has
  for name in ('log_every_steps', 'eval_every_steps', 'checkpoint_every_steps',
               'fewshot_every_steps'):
    if config[name] < 0:
      raise ValueError(f'{name} {config[name]} is negative: set --config.{name} to a '
                       'period in steps, or 0 for only at the end')
  if config.keep_checkpoints == 0 or config.keep_checkpoints < -1:
    raise ValueError(f'keep_checkpoints {config.keep_checkpoints} would keep no checkpoint to '
                     'resume from: set --config.keep_checkpoints to 1 or more (-1 keeps all)')
  if config.get('on_nonfinite', 'stop') not in ON_NONFINITE:
    raise ValueError(f'on_nonfinite {config.on_nonfinite!r} is unknown: set '
                     f'--config.on_nonfinite to one of {ON_NONFINITE}')
  if config.accum_steps < 0:
    raise ValueError(f'accum_steps {config.accum_steps} is negative: set --config.accum_steps '
                     'to 1 or more, or 0 for the fewest micro-batches that fit in memory')
  if config.num_classes == 0 or config.num_classes < -1:
    raise ValueError(f'num_classes {config.num_classes} is no head size: set '
                     '--config.num_classes to the number of classes, or -1 (from the dataset)')
  if dataset_classes and 0 < config.num_classes < dataset_classes:
    raise ValueError(f'num_classes {config.num_classes} is smaller than the dataset\'s '
                     f'{dataset_classes} classes (labels up to {dataset_classes - 1}): set '
                     f'--config.num_classes={dataset_classes} or -1 (from the dataset)')
  if dataset_classes and config.num_classes > dataset_classes:  # a head of classes no image has
    raise ValueError(f'num_classes {config.num_classes} is more than the dataset\'s '
                     f'{dataset_classes} classes ({config.dataset}): set '
                     f'--config.num_classes={dataset_classes} or -1 (from the dataset)')
  if config.dtype not in models.DTYPES:
    raise ValueError(f'dtype {config.dtype!r} is unknown: set --config.dtype to one of '
                     f'{tuple(models.DTYPES)}')
  fields = _variant_fields(config)
  stride = models.pixels_per_token(fields)
  if config.image_size < 1:
    raise ValueError(f'image_size {config.image_size} must be >= 1 (pixels per side): set '
                     '--config.image_size')
  if config.image_size % stride:
    patch = fields.get('patch_size')
    what = f'patch size {stride}' if stride == patch else (
        f'{stride} pixels per token (patch size {patch} on the ResNet stem of the hybrid, '
        f'resnet_layers {tuple(fields["resnet_layers"])}, which divides by {stride // patch})')
    raise ValueError(f'image_size {config.image_size} is not divisible by {what}: set '
                     f'--config.image_size to a multiple of {stride}')
  # An accum_steps that does not divide batch_size is optim.validate's to name.
  accum = max(config.accum_steps, 1)
  # Devices this process split its CPU into may be the reason.
  or_split = sharding.or_other_cpu_devices(config) if devices is None else ''
  if config.batch_size % accum == 0 and config.batch_size // accum % n_dev:
    per_micro = '' if accum == 1 else f' / accum_steps {accum}'
    fixes = ['--config.batch_size'] + ['a smaller --config.accum_steps'] * (accum > 1)
    fixes += [or_split.removeprefix(' or ')] if or_split else []
    raise ValueError(f'batch_size {config.batch_size}{per_micro} must be a multiple of the '
                     f'{n_dev} devices: set {", ".join(fixes[:-1])}'
                     f'{" or " if len(fixes) > 1 else ""}{fixes[-1]}')
  if config.get('device_memory_mb', 0) < 0:
    raise ValueError(f'device_memory_mb {config.device_memory_mb} is negative: set '
                     '--config.device_memory_mb to the memory per device in MiB, or 0 to ask '
                     'the device')
  if config.shuffle_buffer < 1:  # a TFDS source would otherwise read in its stored order
    raise ValueError(f'shuffle_buffer {config.shuffle_buffer} must be >= 1: set '
                     '--config.shuffle_buffer to the examples per host to shuffle among (1: '
                     'no shuffling; local datasets shuffle all of theirs)')
  if config.prefetch < 0:
    raise ValueError(f'prefetch {config.prefetch} is negative: set --config.prefetch to the '
                     'batches to keep in flight to the devices (0 or more)')
  if config.eval_batch_size <= 0:  # (before the devices are known: validate_before_devices)
    raise ValueError(f'eval_batch_size {config.eval_batch_size} must be > 0: set '
                     '--config.eval_batch_size')
  if config.eval_batch_size % n_dev:
    raise ValueError(f'eval_batch_size {config.eval_batch_size} is not a multiple of '
                     f'the {n_dev} devices: set --config.eval_batch_size{or_split}')
  if config.vtab_task and config.vtab_task not in vtab.VTAB:
    raise ValueError(f'vtab_task {config.vtab_task!r} is not a VTAB-1k task: set '
                     f'--config.vtab_task to one of {" ".join(vtab.VTAB)}, or \'\'')
  if not 0 <= config.label_smoothing < 1:
    raise ValueError(f'label_smoothing {config.label_smoothing} is a fraction of the target: '
                     'set --config.label_smoothing to a value in [0, 1)')
  for name in ('dropout_rate', 'attention_dropout_rate'):
    rate = fields.get(name, 0.0)
    if not isinstance(rate, (int, float)) or not 0 <= rate < 1:
      raise ValueError(f'model.{name} {fields[name]} is a probability: set '
                       f'--config.model.{name} to a value in [0, 1)')
  _validate_pp(config)
  if config.pretrained_keep_prelogits and fields.get('representation_size') is None:
    raise ValueError('pretrained_keep_prelogits needs the pre-logits layer in the model: set '
                     '--config.model.representation_size to the checkpoint\'s size')
  masked_patches.validate(config)
  polyak.validate(config)
  validate_fewshot(config)
  device_peaks.validate_given(config.peak_flops_per_device)
  optim.validate(config, num_train_examples)
  trace.validate(config.profile_first_step, config.profile_steps,
                 optim.known_total_steps(config, num_train_examples))


def _variant_fields(config):
  """The model's fields with config.model's. A field its variant lacks was set by the
  config itself (configs.split_model_fields refuses a user's own): the config was written
  for a model of another family, as when --config.model_name=R50x1 meets the quickstart."""
  table = models.VARIANTS.get(config.model_name)
  foreign = sorted(set(config.model) - set(table)) if table else []
  if foreign:
    raise ValueError(f'model_name {config.model_name} ({table["family"]} family) has no field '
                     f'{", ".join(foreign)}, which the config sets in config.model for another '
                     f'model: start from a config for {config.model_name} (e.g. '
                     f'--config=finetune:{config.model_name},<dataset>) or one of your own')
  return models.get_variant(config.model_name, **config.model)


def validate_before_devices(config):
  """validate_config without the devices and the data: the mesh and the batch's split over
  the devices are left out (checked once the backend has started)."""
  config = copy.deepcopy(config)
  config.mesh_data = -1  # all of the one device
  validate_config(config, devices=1, hosts=1)


# --------------------------------------------------------------- few-shot fields
def dataset_labels(datasets):
  """The short names of datasets in metrics and tables: a TFDS name as it is, 'folder:<dir>'
  by the folder's name, or by as many of its last path components as tell it from another
  folder of that name (two folders named data had shared one row). A dataset listed twice
  gets one label twice."""
  parts = [
      d[len('folder:'):].rstrip('/').split('/') if d.startswith('folder:') else [d]
      for d in datasets
  ]
  depth = [1] * len(parts)
  while True:
    labels = ['/'.join(p[-k:]) for p, k in zip(parts, depth)]
    clash = [
        i for i, label in enumerate(labels)
        if any(label == labels[j] and datasets[i] != datasets[j] and depth[i] < len(parts[i])
               for j in range(len(labels)))
    ]
    if not clash:
      return labels
    for i in clash:
      depth[i] += 1


def fewshot_tasks(config):
  """[(label, dataset, train_split, eval_split)] of config.fewshot_datasets (empty: the
  run's dataset and splits); the label names the dataset in metrics and tables."""
  entries = tuple(
      config.fewshot_datasets) or ((config.dataset, config.train_split, config.eval_split),)
  for entry in entries:
    if isinstance(entry, str) or len(entry) != 3:
      raise ValueError(f'fewshot_datasets entry {entry!r} is not (dataset, k-shot pool split, '
                       'held-out split): set e.g. --config.fewshot_datasets="(('
                       "'cifar100', 'train', 'test'),)\"")
  labels = dataset_labels([entry[0] for entry in entries])
  for i, label in enumerate(labels):
    if label in labels[:i]:
      raise ValueError(f'fewshot_datasets names {entries[i][0]!r} twice: list each dataset once')
  return [(label, *entry) for label, entry in zip(labels, entries)]


def validate_fewshot(config):
  """Start-up check of the few-shot fields (one line naming the fix)."""
  old = [k for k in ('fewshot_dataset', 'fewshot_train_split', 'fewshot_eval_split') if k in config]
  if old:
    raise ValueError(f'{", ".join(old)}: replaced by fewshot_datasets, a tuple of (dataset, '
                     'k-shot pool split, held-out split): set e.g. --config.fewshot_datasets='
                     '"((\'imagenet2012\', \'train[:5%]\', \'validation\'),)"')
  if config.fewshot_every_steps:
    fewshot_tasks(config)
    for field, ok, want in (('fewshot_shots', lambda k: k >= 1, 'whole numbers >= 1'),
                            ('fewshot_seeds', lambda s: True, 'whole numbers')):
      values = config[field]
      if not (isinstance(values, (tuple, list)) and values
              and all(isinstance(v, int) and not isinstance(v, bool) and ok(v) for v in values)):
        raise ValueError(f'{field} {values!r} is not a tuple of {want}: set e.g. '
                         f'--config.{field}=1,5')
      if len(set(values)) < len(values):  # one draw twice would read as a spread of 0
        raise ValueError(f'{field} {tuple(values)!r} gives a value twice: set '
                         f'--config.{field} with each once')
    if not float(config.fewshot_l2_reg) > 0:
      raise ValueError(f'fewshot_l2_reg {config.fewshot_l2_reg} is not positive: set '
                       '--config.fewshot_l2_reg (the paper\'s few-shot ridge: 1024)')
    if config.fewshot_cache_mb < 0:
      raise ValueError(f'fewshot_cache_mb {config.fewshot_cache_mb} is negative: set '
                       '--config.fewshot_cache_mb to the MiB of held-out images to keep in '
                       'memory (0: read them again at each evaluation)')
