"""The flags that name a model in the evaluate, inspect and predict programs, and loading it.

Either a finished training run, `--workdir DIR` (its config.json and final.npz: model,
resolution and data come from the run; with `--step N`, its checkpoint of step N instead),
or a published-format file, `--checkpoint F.npz --model NAME [--model_overrides ...]
[--image_size N]`.
"""
import ast
import re
import sys

from absl import flags
import flax
import numpy as np


def define_flags():
  """Defines the model flags on absl's global FLAGS (only when a program runs)."""
  flags.DEFINE_string(
      'workdir', None, 'A finished vit-train run: reads its config.json and '
      'final.npz (model, resolution and dataset come from the run).')
  flags.DEFINE_integer(
      'step', None, "With --workdir: the run's checkpoint of this step (WORKDIR/checkpoints/"
      'STEP) instead of its final.npz, e.g. while it trains; the parameters the run evaluates '
      '(its Polyak average, where it keeps one).', lower_bound=0)
  flags.DEFINE_string('checkpoint', None, 'A published-format .npz file (instead of --workdir).')
  flags.DEFINE_string(
      'model', None, 'With --checkpoint (required there): a name from '
      'vit_jax.models.VARIANTS, e.g. ViT-B_16.')
  flags.DEFINE_string(
      'model_overrides', '', 'With --checkpoint: variant overrides, '
      'name=value,... (e.g. num_layers=2,hidden_size=32).')
  flags.DEFINE_integer(
      'image_size', None, "With --checkpoint: the resolution (default: the file's own, from its "
      'position embeddings, e.g. 384 for a fine-tuned ImageNet file; 224 for a ResNet).')


def parse_overrides(text):
  """'num_layers=2,hidden_size=32' -> {'num_layers': 2, 'hidden_size': 32}."""
  out = {}
  for item in filter(None, (s.strip() for s in (text or '').split(','))):
    if '=' not in item:
      raise ValueError(f'Model override {item!r} is not name=value: e.g. num_layers=2')
    name, value = item.split('=', 1)
    try:
      out[name.strip()] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      out[name.strip()] = value.strip()
  return out


def load(flags_):
  """(run config or None, model, params, image_size) named by the flags."""
  # pylint: disable-next=g-import-not-at-top  (orbax: only when a model is loaded)
  from vit_jax import checkpoint
  workdir = getattr(flags_, 'workdir', None)
  if bool(workdir) == bool(flags_.checkpoint):
    raise ValueError('Name one model: --workdir DIR (a finished vit-train run) or '
                     '--checkpoint FILE.npz with --model NAME')
  step = getattr(flags_, 'step', None)
  if step is not None and not workdir:
    raise ValueError(f'--step {step} only with --workdir: it names a checkpoint of a vit-train '
                     'run (WORKDIR/checkpoints/STEP); a --checkpoint file has no steps')
  ignored = [
      f'--{name}' for name in ('model', 'model_overrides', 'image_size')
      if getattr(flags_, name, None) not in (None, '')
  ]
  if workdir and ignored:  # would be ignored: the run's config.json names all three
    raise ValueError(f'{" and ".join(ignored)} only with --checkpoint: --workdir {workdir} '
                     'brings the run\'s own model, overrides and resolution (its config.json); '
                     f'drop {" and ".join(ignored)}')
  image_size = getattr(flags_, 'image_size', None)
  if image_size is not None and image_size < 1:
    raise ValueError(f'--image_size={image_size}: pass the resolution in pixels (1 or '
                     'more), or leave it out for 224')
  if workdir:
    config, model, params = checkpoint.load_run(workdir, step)
    image_size = config.image_size
  else:
    if not flags_.model:  # a file's shapes alone do not name its patch size or variant
      raise ValueError(f'--checkpoint {flags_.checkpoint} needs --model NAME: the model the '
                       'file was trained as, e.g. ViT-B_16 (names: vit_jax.models.VARIANTS)')
    config, overrides = None, parse_overrides(flags_.model_overrides)
    try:
      model, params = checkpoint.load_model(flags_.checkpoint, flags_.model, image_size,
                                            **overrides)
      if image_size is None:  # what load_model chose: the file's own resolution, else 224
        flat = flax.traverse_util.flatten_dict(params, sep='/')
        image_size = checkpoint.file_image_size(flat, flags_.model, **overrides) or 224
    except checkpoint.IncompatibleCheckpointError as e:  # names vit-train's way to pick it
      raise ValueError(f'{e} (--model, and --model_overrides for sizes that differ from the '
                       'variant\'s, e.g. num_layers=4,hidden_size=64)') from None
    except ValueError as e:  # an override the model refuses: its fix in this command's flag
      raise ValueError(re.sub(r'--config\.model\.(\w+)', r'--model_overrides \1=N',
                              str(e))) from None
  bad = [
      k for k, v in flax.traverse_util.flatten_dict(params, sep='/').items()
      if not np.all(np.isfinite(np.asarray(v)))
  ]
  if bad:
    print(
        f'warning: {len(bad)} parameter arrays hold NaN or Inf (e.g. {bad[0]}): the run '
        'diverged and every output below is meaningless', file=sys.stderr)
  return config, model, params, image_size
