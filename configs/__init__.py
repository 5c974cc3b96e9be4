r"""The packaged configs (installed as vit_jax.configs), and how a --config value names one.

A --config value is a config file with an optional argument after ':' (your own file, or
'configs/finetune.py:ViT-B_16,cifar10' in a checkout), or the name of a packaged config,
which works from any directory once the package is installed:

  quickstart                      the offline default (Fashion-MNIST)
  finetune:<model>,<dataset>      Table 4 rows, e.g. finetune:ViT-B_16,cifar10
  pretrain:<model>,<dataset>      Table 3 rows, e.g. pretrain:ViT-B_16,imagenet21k

An existing file wins over a packaged name.
"""
import importlib.util
import os

PACKAGED = ('quickstart', 'finetune', 'pretrain')
EXAMPLES = '--config=quickstart, --config=finetune:ViT-B_16,cifar10 or a file path'


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


def load(spec):
  """The ConfigDict that `--config=spec` gives (without command-line overrides)."""
  path, _, arg = resolve(spec).partition(':')
  module_spec = importlib.util.spec_from_file_location('_vit_jax_config', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()
