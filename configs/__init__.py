r"""The packaged configs (installed as vit_jax.configs), and how a --config value names one.

A --config value is a config file with an optional argument after ':' (your own file, or
'configs/finetune.py:ViT-B_16,cifar10' in a checkout), or the name of a packaged config,
which works from any directory once the package is installed:

  quickstart                      the offline default (Fashion-MNIST)
  finetune:<model>,<dataset>      Table 4 rows, e.g. finetune:ViT-B_16,cifar10
  pretrain:<model>,<dataset>      Table 3 rows, e.g. pretrain:ViT-B_16,imagenet21k
  table2:<model>                  Table 2's ImageNet recipe: table2:ViT-L_16, table2:ViT-H_14
  masked_patches:<model>,<data>   Section 4.6 self-supervised rows (and :quickstart)

An existing file wins over a packaged name.
"""
import difflib
import importlib.util
import os
import re

from absl import flags
import ml_collections
from ml_collections import config_flags

from vit_jax import errors

PACKAGED = ('quickstart', 'finetune', 'pretrain', 'table2', 'masked_patches')
EXAMPLES = '--config=quickstart, --config=finetune:ViT-B_16,cifar10 or a file path'


def bad_argument(name, arg, usage):
  """The one-line ValueError of a packaged config whose argument does not parse (arg None or
  empty: none was given)."""
  given = arg and arg.strip()
  what = f'Bad {name} argument {arg!r}' if given else f'--config={name} needs an argument'
  return ValueError(f'{what}: use {usage}')


class ConfigNotFoundError(ValueError):
  """A --config value that names neither a file nor a packaged config."""


def resolve(spec):
  """'finetune:ViT-B_16,cifar10' -> '<package dir>/finetune.py:ViT-B_16,cifar10'.

  A path to an existing file is returned unchanged; anything else that is not a packaged
  name raises ConfigNotFoundError with a one-line message naming the fix.
  """
  path, sep, arg = spec.partition(':')
  if os.path.isfile(os.path.expanduser(path)):
    return os.path.expanduser(path) + sep + arg
  if path in PACKAGED:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), f'{path}.py') + sep + arg
  where = '' if os.path.isabs(path) else f' (relative to {os.getcwd()})'
  raise ConfigNotFoundError(f'--config {spec!r}: no config file {path}{where}, and '
                            f'{path!r} is not a packaged config ({", ".join(PACKAGED)}): '
                            f'use {EXAMPLES}')


def load(spec, overrides=()):
  """The ConfigDict of `--config=spec` and `--config.x=value` overrides, as vit-train
  builds it (ml_collections parses the values; unknown fields are one-line errors)."""
  path, _, arg = resolve(spec).partition(':')
  module_spec = importlib.util.spec_from_file_location('_vit_jax_config', path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except SyntaxError as e:
    raise ValueError(f'{e.filename}:{e.lineno}: {e.msg}: fix the config file') from None
  except ImportError as e:
    raise ValueError(f'{path}: {e}: fix the import in the config file') from None
  if not callable(getattr(module, 'get_config', None)):
    raise ValueError(f'{path} defines no get_config(): a config file returns its ConfigDict '
                     'from get_config()')
  config = module.get_config(arg) if arg else module.get_config()
  _check_complete(config, path)
  if not overrides:
    return config
  check_override_names(config, overrides)
  argv = ['vit_jax', f'--config={resolve(spec)}', *overrides]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, '', flag_values=flag_values, sys_argv=argv)
  try:
    flag_values(argv)
  except flags.Error as e:
    raise ValueError(errors.plain_value_error(str(e).strip().splitlines()[0])) from None
  return flag_values.config


def _check_complete(config, path):
  """A config of one's own must hold every field of common.py (where each is explained)."""
  from vit_jax.configs import common  # pylint: disable=g-import-not-at-top  (this package)
  if not isinstance(config, ml_collections.ConfigDict):
    raise ValueError(f'{path}: get_config() returned a {type(config).__name__}, not an '
                     'ml_collections.ConfigDict: start from vit_jax.configs.common.get_config()')
  missing = [k for k in common.get_config() if k not in config]
  if missing:
    shown = ', '.join(missing[:5]) + (f' and {len(missing) - 5} more' if len(missing) > 5 else '')
    raise ValueError(f'{path}: the config lacks {shown}: start from '
                     'vit_jax.configs.common.get_config() and set what differs')


def check_override_names(config, args):
  """Each --config.<path>=... in `args` must name a field: a one-line ValueError with the
  nearest names if not."""
  for arg in args:
    match = re.match(r'^--?(?:no)?config\.([\w.]+)', arg)
    if not match:
      continue
    node, done = config, []
    for part in match.group(1).split('.'):
      fields = list(node.keys()) if hasattr(node, 'keys') else []
      if part not in fields:
        close = difflib.get_close_matches(part, fields, n=3)
        if not close:  # a short name the field ends with: lr -> base_lr, end_lr
          close = [f for f in fields if f.endswith('_' + part)][:3]
        hint = f' (did you mean {", ".join(close)}?)' if close else ''
        where = 'config' if not done else 'config.' + '.'.join(done)
        raise ValueError(f'--config.{match.group(1)}: the {where} has no field {part!r}{hint}; '
                         'every field is listed with its meaning in configs/common.py (installed: '
                         'vit_jax.configs.common)')
      node, done = node[part], done + [part]
