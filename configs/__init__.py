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
import ast
import contextlib
import difflib
import importlib.util
import os
import re
import sys
import traceback
import warnings

from absl import flags
import ml_collections
from ml_collections import config_flags

from vit_jax import errors

PACKAGED = ('quickstart', 'finetune', 'pretrain', 'table2', 'masked_patches')
EXAMPLES = '--config=quickstart, --config=finetune:ViT-B_16,cifar10 or a file path'
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


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
    return os.path.join(_PACKAGE_DIR, f'{path}.py') + sep + arg
  where = '' if os.path.isabs(path) else f' (relative to {os.getcwd()})'
  raise ConfigNotFoundError(f'--config {spec!r}: no config file {path}{where}, and '
                            f'{path!r} is not a packaged config ({", ".join(PACKAGED)}): '
                            f'use {EXAMPLES}')


@contextlib.contextmanager
def loading_a_config():
  """Around running a config file (here, and by ml_collections' --config flag): Python writes
  no __pycache__ (a command refused for a bad value had left __pycache__/<name>.cpython-*.pyc
  beside a user's config), and ml_collections' use of the deprecated load_module() warns
  nothing (with PYTHONWARNINGS=error, that warning had stopped every command that loads a
  config)."""
  before, sys.dont_write_bytecode = sys.dont_write_bytecode, True
  try:
    with warnings.catch_warnings():
      warnings.filterwarnings('ignore', r'the load_module\(\) method is deprecated',
                              DeprecationWarning)
      yield
  finally:
    sys.dont_write_bytecode = before


def load(spec, overrides=()):
  """The ConfigDict of `--config=spec` and `--config.x=value` overrides, as vit-train
  builds it (ml_collections parses the values; unknown fields are one-line errors)."""
  with loading_a_config():
    return _load(spec, overrides)


def _load(spec, overrides):
  path, _, arg = resolve(spec).partition(':')
  module_spec = importlib.util.spec_from_file_location('_vit_jax_config', path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except SyntaxError as e:
    raise ValueError(f'{e.filename}:{e.lineno}: {e.msg}: fix the config file') from None
  except ImportError as e:
    raise ValueError(f'{path}: {e}: fix the import in the config file') from None
  except Exception as e:  # pylint: disable=broad-except  (a NameError, ... as it runs)
    raise _failed_in(path, e) from None
  if not callable(getattr(module, 'get_config', None)):
    raise ValueError(f'{path} defines no get_config(): a config file returns its ConfigDict '
                     'from get_config()')
  try:
    config = module.get_config(arg) if arg else module.get_config()
  except (TypeError, ValueError) as e:
    if os.path.dirname(os.path.abspath(path)) == _PACKAGE_DIR:
      raise  # the packaged configs' own errors name their fix
    call = f'get_config({arg!r})' if arg else 'get_config()'
    raise ValueError(f'{path}: {call} failed ({errors.one_line(e)}): fix the config file or '
                     "the argument after ':' in --config") from None
  except Exception as e:  # pylint: disable=broad-except
    if os.path.dirname(os.path.abspath(path)) == _PACKAGE_DIR:
      raise  # a fault of ours: its traceback
    raise _failed_in(path, e) from None
  _check_complete(config, path)
  before = config  # (the overrides are applied to a config loaded anew)
  check_overrides_once(overrides)
  overrides, model_fields = split_model_fields(config, overrides)
  check_override_names(config, overrides)
  if overrides:
    argv = ['vit_jax', f'--config={resolve(spec)}', *overrides]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file('config', None, '', flag_values=flag_values, sys_argv=argv)
    try:
      flag_values(argv)
    except flags.Error as e:
      raise ValueError(errors.plain_value_error(str(e).strip().splitlines()[0])) from None
    config = flag_values.config
  add_model_fields(config, model_fields)
  check_model_name_takes_effect(before, config)
  return config


def _failed_in(path, error):
  """One line for an exception a user's config file raised (a NameError, a KeyError, ...):
  the line of the file it was raised from, its type and its text. It had been a traceback."""
  lines = [
      f.lineno for f in traceback.extract_tb(error.__traceback__)
      if os.path.abspath(f.filename) == os.path.abspath(path)
  ]
  where = f'{path}:{lines[-1]}' if lines else path
  return ValueError(f'{where}: {type(error).__name__}: {errors.one_line(error)}: fix the config '
                    'file')


def check_model_name_takes_effect(config, final):
  """Refuses a --config.model_name whose variant differs from the config's only in fields
  the config's own model sets otherwise: the quickstart's 4-layer ViT had trained as
  'ViT-L_16', the name recorded in config.json and nothing else changed."""
  if final.model_name == config.model_name:
    return
  from vit_jax.models import variants  # pylint: disable=g-import-not-at-top  (JAX: see above)
  old, new = variants.VARIANTS.get(config.model_name), variants.VARIANTS.get(final.model_name)
  if old is None or new is None or old['family'] != new['family']:
    return  # config_checks names these
  differ = sorted(k for k in new if new[k] != old[k])
  kept = [k for k in differ if k in final.model and final.model[k] != new[k]]
  if differ and kept == differ:
    raise ValueError(
        f'--config.model_name={final.model_name} changes only the name: the config sets '
        f'{", ".join(f"model.{k}" for k in kept)}, every field where {final.model_name} differs '
        f'from {config.model_name}: set them too (--config.model.FIELD=VALUE), or start from a '
        f'config for {final.model_name} (e.g. --config=finetune:{final.model_name},<dataset>)')


_MODEL_FIELD = re.compile(r'^--?config\.model\.(\w+)(?:=(.*))?$', re.S)
_MODEL_NAME = re.compile(r'^--?config\.model_name(?:=(.*))?$', re.S)


def split_model_fields(config, args):
  """(`args` without them, {name: value}) for the --config.model.NAME=VALUE in `args` whose
  NAME the config's model does not hold but the model's variant has (num_layers on a
  fine-tuning config, say). ml_collections sets only the fields a config holds, so these
  are added to the parsed config by add_model_fields. A NAME the variant lacks is a
  one-line ValueError naming the variant's fields."""
  args = list(args)
  if not any((m := _MODEL_FIELD.match(arg)) and m.group(1) not in config.model for arg in args):
    return args, {}
  # Here, not at the top: vit_jax.models imports JAX and Flax (1 s), which vit-train's
  # start-up (host_allocator's re-execution) and the quickstart's config do without.
  from vit_jax.models import variants  # pylint: disable=g-import-not-at-top
  model_name = config.model_name
  for i, arg in enumerate(args):  # the last --config.model_name=X wins, as in absl
    match = _MODEL_NAME.match(arg)
    if match and (match.group(1) is not None or i + 1 < len(args)):
      model_name = match.group(1) if match.group(1) is not None else args[i + 1]
  variant = variants.VARIANTS.get(model_name)  # an unknown name's error comes later
  rest, fields, i = [], {}, 0
  while i < len(args):
    match = _MODEL_FIELD.match(args[i])
    if not match or variant is None or match.group(1) in config.model:
      rest.append(args[i])
      i += 1
      continue
    name, text = match.groups()
    if text is None:  # '--config.model.NAME VALUE'
      text = args[i + 1] if i + 1 < len(args) else ''
      i += 1
    i += 1
    allowed = sorted(set(variant) - {'family'})
    if name not in allowed:
      close = difflib.get_close_matches(name, allowed, n=3)
      hint = f' (did you mean {", ".join(close)}?)' if close else ''
      raise ValueError(f'--config.model.{name}: model {model_name} has no field {name!r}{hint}; '
                       f'its fields: {", ".join(allowed)}')
    default = variant[name]
    kind = variants.OPTIONAL_FIELD_TYPES[name] if default is None else type(default)
    fields[name] = _model_field_value(name, text, kind, optional=default is None)
  return rest, fields


def _model_field_value(name, text, kind, optional):
  """The value of --config.model.NAME=text as a `kind` (or None where `optional`)."""
  if kind is str:
    return text
  try:
    value = ast.literal_eval(text.strip())
  except (ValueError, SyntaxError, MemoryError, RecursionError):
    value = text
  if isinstance(value, list):
    value = tuple(value)
  if kind is float and type(value) is int:  # pylint: disable=unidiomatic-typecheck
    value = float(value)
  if type(value) is kind or (value is None and optional):  # bool is not an int here
    return value
  what = {int: 'an integer', float: 'a number', tuple: 'a tuple of integers such as (3,4,9)'}[kind]
  raise ValueError(f'flag --config.model.{name}={text}: expected {what}'
                   f'{" or None" if optional else ""}')


def add_model_fields(config, fields):
  """Adds split_model_fields's `fields` to the (parsed) config's model."""
  if fields:
    with config.unlocked():
      config.model.update(fields)


def _check_complete(config, path):
  """A config of one's own must hold every field of common.py (where each is explained)."""
  from vit_jax.configs import common  # pylint: disable=g-import-not-at-top  (this package)
  if not isinstance(config, ml_collections.ConfigDict):
    raise ValueError(f'{path}: get_config() returned a {type(config).__name__}, not an '
                     'ml_collections.ConfigDict: start from vit_jax.configs.common.get_config()')
  defaults = common.get_config()
  missing = [k for k in defaults if k not in config]
  if missing:
    shown = ', '.join(missing[:5]) + (f' and {len(missing) - 5} more' if len(missing) > 5 else '')
    raise ValueError(f'{path}: the config lacks {shown}: start from '
                     'vit_jax.configs.common.get_config() and set what differs')
  # ConfigDict takes None for any field; the checks compare numbers (a TypeError traceback).
  unset = [name for name, value in _leaves(defaults) if _leaf(config, name) is None]
  if unset:
    one = len(unset) == 1
    raise ValueError(f'{path}: {", ".join(unset)} {"is" if one else "are"} None: give '
                     f'{"it" if one else "each"} a value (configs/common.py says what each field '
                     'holds), or leave the default of common.get_config()')


def _leaves(config, prefix=''):
  """(dotted name, value) of every field of config below its sub-configs; config.model's are
  the model's own (None where it has no such part) and are left out."""
  for name, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      if name != 'model':
        yield from _leaves(value, f'{prefix}{name}.')
    else:
      yield f'{prefix}{name}', value


def _leaf(config, dotted):
  for part in dotted.split('.'):
    config = config.get(part) if isinstance(config, ml_collections.ConfigDict) else None
  return config


# Top-level names that google-research/vision_transformer's and big_vision's configs (and
# optax) give to fields this config calls otherwise, for the hint of an unknown name.
OTHER_NAMES = {
    'learning_rate': ('base_lr',),
    'wd': ('weight_decay',),
    'decay_type': ('lr_decay',),
    'schedule': ('lr_decay', 'warmup_steps'),
    'batch': ('batch_size',),
    'batch_eval': ('eval_batch_size',),
    'input': ('batch_size', 'dataset', 'pp'),
    'pp_train': ('pp',),
    'progress_every': ('log_every_steps',),
    'ckpt_steps': ('checkpoint_every_steps',),
    'keep_ckpt_steps': ('keep_checkpoints',),
    'total_epochs': ('num_epochs',),
    'pretrained_dir': ('pretrained_path',),
    'model_init': ('pretrained_path',),
    'model_file': ('pretrained_path',),
    'optax_name': ('optimizer',),
    'ema': ('polyak_decay',),
    'half_precision': ('dtype',),
    'mixed_precision': ('dtype',),
    'max_steps': ('total_steps',),
    'num_steps': ('total_steps',),
}


def check_overrides_once(args):
  """A one-line ValueError for a config field set more than once in `args` (ml_collections,
  like absl, takes the last: `--config.total_steps=2 ... --config.total_steps=3` ran 3)."""
  seen = {}
  for i, arg in enumerate(args):
    match = re.match(r'^--?(no)?config\.([\w.]+)(=(.*))?$', arg, re.S)
    if not match:
      continue
    negated, path, eq, value = match.groups()
    following = args[i + 1] if i + 1 < len(args) else ''
    if negated:  # `--noconfig.flag`
      value = 'False'
    elif not eq:  # `--config.x VALUE`, or a boolean `--config.flag`
      value = following if following and not following.startswith('-') else 'True'
    seen.setdefault(path, []).append(value)
    if len(seen[path]) > 1:
      raise ValueError(f'--config.{path} is given more than once '
                       f'({", ".join(map(repr, seen[path]))}): give one')


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
        close = [] if done else [f for f in OTHER_NAMES.get(part, ()) if f in fields]
        close = close or difflib.get_close_matches(part, fields, n=3)
        if not close:  # a short name the field ends with: lr -> base_lr, end_lr
          close = [f for f in fields if f.endswith('_' + part)][:3]
        hint = f' (did you mean {", ".join(close)}?)' if close else ''
        where = 'config' if not done else 'config.' + '.'.join(done)
        raise ValueError(f'--config.{match.group(1)}: the {where} has no field {part!r}{hint}; '
                         'every field is listed with its meaning in configs/common.py (installed: '
                         'vit_jax.configs.common)')
      node, done = node[part], done + [part]
    if hasattr(node, 'keys') and '=' in arg:  # absl: "Failed to parse 'X' as a ConfigDict"
      path = match.group(1)
      variant = ('; a model variant is chosen with --config.model_name=ViT-L_16'
                 if path == 'model' else '')
      raise ValueError(f'--config.{path} is a group of fields ({", ".join(list(node)[:3])}, '
                       f'...): set one as --config.{path}.FIELD=VALUE{variant}')
