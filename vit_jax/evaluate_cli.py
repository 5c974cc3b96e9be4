r"""vit-evaluate: top-1 (also ImageNet ReaL) and few-shot linear accuracy of a checkpoint.

  vit-evaluate --workdir workdirs/quickstart      # a finished run: top-1 and few-shot
  vit-evaluate --checkpoint ViT-B_16.npz --model ViT-B_16 --dataset cifar10 --mode fewshot
  vit-evaluate --workdir workdirs/imagenet --dataset imagenet2012_real   # ReaL top-1
  vit-evaluate --workdir workdirs/jft --mode fewshot --fewshot_datasets cifar100,oxford_iiit_pet

(python -m vit_jax.evaluate_cli is the same.) Settings not given on the command line are
the run's (--workdir), else those of configs/common.py. The evaluation itself is
vit_jax/evaluate.py.
"""
import math
import re
import sys

from absl import flags

from vit_jax import cli_help
from vit_jax import config_checks
from vit_jax import errors
from vit_jax import model_flags
from vit_jax import paths
from vit_jax.configs import common

# The evaluation (evaluate, input_pipeline, rundir) loads TensorFlow, ~5 s: it is imported
# where used, once the arguments and the model have been checked, so that a command
# refused for them, and --help, do not wait for it.

_DEFAULTS = common.get_config()
_DEFAULT_BATCH = 64  # --batch_size for a --checkpoint file (no run to take it from)


def cli_config(**fields):
  """A full config (configs/common.py) with `fields` set: the CLI's, and tests'."""
  c = common.get_config()
  for name, value in fields.items():
    if name == 'pp':
      c.pp.update(value)
    else:
      c[name] = value
  return c


def _define_flags():
  """The CLI's flags, defined only when run as a program (importing defines none)."""
  model_flags.define_flags()
  flags.DEFINE_string(
      'dataset', None, "TFDS name, 'folder:<dir>' or 'fashion_mnist_local' "
      '(default: the run\'s, else fashion_mnist_local).')
  flags.DEFINE_string('data_dir', None, 'TFDS data_dir or the folder of the IDX files '
                      '(default: the run\'s).')
  flags.DEFINE_enum('eval_crop', None, ['resize', 'central'], 'Evaluation crop (default: the '
                    'run\'s, else resize).')
  flags.DEFINE_enum(
      'mode', None, ['fewshot', 'top1', 'all'], 'What to evaluate (default: all '
      'for the --workdir of a classifier, fewshot for --checkpoint or a '
      'masked-patch run).')
  flags.DEFINE_string('train_split', None, 'Split the k-shot examples come from (default: the '
                      'run\'s, else train).')
  flags.DEFINE_string('eval_split', None, 'Held-out split, top-1 and few-shot (default: the '
                      'run\'s, else test).')
  flags.DEFINE_list(
      'fewshot_datasets', None, 'Datasets of the few-shot evaluation, each read '
      'with --train_split and --eval_split; several give per-dataset rows and '
      'their mean (default: --dataset).')
  flags.DEFINE_list('shots', [str(k) for k in _DEFAULTS.fewshot_shots], 'Shots per class.')
  flags.DEFINE_bool(
      'standardise', _DEFAULTS.fewshot_standardise, 'Standardise the features '
      'by the k-shot set\'s mean and deviation before the fit (see fewshot_standardise '
      'in configs/common.py).')
  flags.DEFINE_list('seeds', [str(s) for s in _DEFAULTS.fewshot_seeds],
                    'Seeds of the k-shot draws.')
  flags.DEFINE_float('l2_reg', _DEFAULTS.fewshot_l2_reg,
                     'Ridge regulariser of the few-shot regression.')
  flags.DEFINE_integer(
      'batch_size', None, "Global evaluation batch size (default: the --workdir run's own, "
      'eval_batch_size and fewshot_batch_size, so that a bfloat16 run\'s numbers round as the '
      f'run\'s did; else {_DEFAULT_BATCH}). Lower it where this host has less memory than the '
      "run's.", lower_bound=1)
  return flags.FLAGS


def _batch_sizes(flags_, run_config, devices):
  """(top-1 batch, few-shot feature batch): --batch_size where given, else the run's own
  (the batch shape decides how bf16 sums round: another gave a run's 0.5011 as 0.5006), each
  made a multiple of `devices` where the run had another count; else _DEFAULT_BATCH."""
  given = getattr(flags_, 'batch_size', None)
  if given is not None or run_config is None:
    return (given or _DEFAULT_BATCH,) * 2
  top1 = run_config.get('eval_batch_size') or _DEFAULT_BATCH
  fewshot = run_config.get('fewshot_batch_size') or top1
  return tuple(max(devices, b - b % devices) for b in (top1, fewshot))


def format_table(rows):
  """[(mode, metric, value text)] -> an aligned text table."""
  rows = [('mode', 'metric', 'value')] + list(rows)
  widths = [max(len(r[i]) for r in rows) for i in range(2)]
  return '\n'.join(f'{a:<{widths[0]}}  {b:<{widths[1]}}  {c}' for a, b, c in rows)


def _setting(flags_, name, run_config, run_value, default):
  """A flag given on the command line, else the run's value, else the default."""
  value = getattr(flags_, name, None)
  if value is not None:
    return value
  return run_value if run_config is not None else default


def run(flags_):
  """Evaluates per the flags; returns the table as text."""
  shots, seeds = _whole_numbers(flags_, 'shots', 1), _whole_numbers(flags_, 'seeds', 0)
  if not 0 < flags_.l2_reg < math.inf:  # inf: every prediction would be the same class
    raise ValueError(f'--l2_reg={flags_.l2_reg} is not a positive number: use e.g. '
                     f'--l2_reg={_DEFAULTS.fewshot_l2_reg:g} (the default)')
  run_config, model, params, image_size = model_flags.load(flags_)
  import jax  # pylint: disable=g-import-not-at-top  (loaded by model_flags.load)
  top1_batch, fewshot_batch = _batch_sizes(flags_, run_config, jax.device_count())
  # pylint: disable=g-import-not-at-top,unused-import  (TensorFlow: see the imports above)
  from vit_jax import tensorflow_quietly  # noqa: F401  (first: before TensorFlow loads)
  from vit_jax import evaluate
  from vit_jax import input_pipeline
  # pylint: enable=g-import-not-at-top,unused-import
  rc = run_config or {}
  pp = rc.get('pp', {})
  get = lambda name, default: _setting(flags_, name, run_config, rc.get(name), default)
  dataset = get('dataset', 'fashion_mnist_local')
  real = dataset == evaluate.REAL_DATASET
  label_key = (evaluate.REAL_LABEL_KEY if real else
               rc.get('label_key', 'label') if dataset == rc.get('dataset') else 'label')
  config = cli_config(
      dataset=dataset, data_dir=get('data_dir', _DEFAULTS.data_dir), label_key=label_key,
      image_size=image_size, pp=dict(
          eval_crop=_setting(flags_, 'eval_crop', run_config, pp.get('eval_crop'),
                             _DEFAULTS.pp.eval_crop),
          central_crop_fraction=pp.get('central_crop_fraction',
                                       _DEFAULTS.pp.central_crop_fraction)))
  eval_split = (getattr(flags_, 'eval_split', None) or evaluate.REAL_SPLIT) if real else get(
      'eval_split', _DEFAULTS.eval_split)
  train_split = get('train_split', _DEFAULTS.train_split)
  classifier = run_config is not None and rc.get('objective', 'classification') == 'classification'
  mode = getattr(flags_, 'mode', None) or ('top1' if real else 'all' if classifier else 'fewshot')
  if real and mode != 'top1':
    raise ValueError(f'{evaluate.REAL_DATASET} holds only the ReaL labels of ImageNet\'s '
                     'validation images, for top-1: use --mode top1')
  fewshot = mode in ('fewshot', 'all')
  # A plain namespace (tests, notebooks) cannot tell: taken as not given here.
  typed = [f'--{name}' for name in _FEWSHOT_FLAGS if _typed(flags_, name, unknown=False)]
  if typed and not fewshot:
    raise ValueError(f'{", ".join(typed)} only with --mode fewshot or all: --mode {mode} draws no '
                     f'k-shot sets; drop {"them" if len(typed) > 1 else "it"}')
  top1 = mode in ('top1', 'all')
  datasets = _fewshot_datasets(flags_) or [config.dataset]
  fewshot_skipped = None
  if mode == 'all' and not _typed(flags_, 'mode') and not typed and datasets == [config.dataset]:
    # The default mode on a held-out set without training images: top-1, and why no k-shot.
    try:
      input_pipeline.count_split(evaluate.data_config(config, split=train_split), 'train_split')
    except ValueError as e:
      fewshot, fewshot_skipped = False, _own_flags(str(e))
  # Each split read, before any features: one that a dataset lacks names its own flag. (The
  # run's dataset only for top-1: few-shot on other datasets does not need it.)
  reads = [(config.dataset, 'eval_split', eval_split)] if top1 else []
  if fewshot:
    reads += [(d, 'train_split', train_split) for d in datasets]
    reads += [(d, 'eval_split', eval_split) for d in datasets]
  for dataset, field, split in dict.fromkeys(reads):
    input_pipeline.count_split(evaluate.data_config(config, dataset=dataset, split=split), field)
  if fewshot:  # shots a k-shot pool cannot draw: refused before any features where it can be
    for dataset, label in zip(datasets, config_checks.dataset_labels(datasets)):
      cfg = evaluate.data_config(config, dataset=dataset, split=train_split)
      pool = input_pipeline.split_labels(cfg, 'train_split')
      if pool is not None:
        _shots_that_fit(flags_, shots, pool, cfg, train_split, label)
  rows = []
  if top1:
    if run_config is not None and not classifier:
      raise ValueError(f'{flags_.workdir} is a {rc["objective"]} run: its head predicts '
                       'no class, so there is no top-1: use --mode fewshot (its default)')
    head_index = _head_index(flags_, config, eval_split, model.num_classes)
    acc, n, undecodable = evaluate.top1_accuracy(model, params, config, eval_split, top1_batch,
                                                 head_index)
    of = '' if head_index is None else f' of {len(head_index)} of the {model.num_classes} classes'
    counted = f'{n} images with a ReaL label' if real else errors.count_of(n, 'image')
    counted += of + evaluate.not_counted(undecodable)
    rows.append(('top1', f'{eval_split} ReaL' if real else eval_split, f'{acc:.4f}  ({counted})'))
  if fewshot:
    rows += _fewshot_rows(flags_, model, params, config, datasets, train_split, eval_split, shots,
                          seeds, fewshot_batch)
  if fewshot_skipped:
    rows.append(
        ('fewshot', config_checks.dataset_labels(datasets)[0], f'skipped: {fewshot_skipped}'))
  return format_table(rows)


def _head_index(flags_, config, eval_split, head_classes):
  """The head's class of each of the dataset's labels where the dataset names its classes
  otherwise than the run recorded but all of them among the run's (a held-out folder of
  some of its classes): matched by name. None where label k is the head's class k.
  Refuses a dataset the head cannot be read on: another number of classes and no names
  recorded, or a class the run did not train (a folder renamed, or another folder)."""
  # pylint: disable=g-import-not-at-top  (loaded by run)
  from vit_jax import evaluate
  from vit_jax import input_pipeline
  from vit_jax import rundir
  # pylint: enable=g-import-not-at-top
  workdir = getattr(flags_, 'workdir', None)
  recorded = rundir.recorded_class_names(paths.resolve(workdir)) if workdir else None
  names = list(input_pipeline.class_names(evaluate.data_config(config, split=eval_split)))
  if recorded is None or names == recorded or config.dataset == evaluate.REAL_DATASET:
    if head_classes != len(names):
      raise ValueError(f'The checkpoint head has {head_classes} classes but '
                       f'{config.dataset} has {len(names)}: use --mode fewshot')
    return None
  if len(recorded) != head_classes:
    raise ValueError(f'{rundir.CLASS_NAMES_FILE} of {workdir} names {len(recorded)} classes but '
                     f'the checkpoint head has {head_classes}, so they are of different runs: '
                     'run vit-train again with the same --workdir')
  untrained = [n for n in names if n not in recorded]
  if untrained:
    listed = ', '.join(repr(n) for n in untrained[:3]) + (', ...' if len(untrained) > 3 else '')
    raise ValueError(
        f'{config.dataset} has {len(untrained)} class(es) the run did not train ({listed}; '
        f'{rundir.CLASS_NAMES_FILE} of {workdir} names its {len(recorded)}): top-1 reads the '
        "head's classes by name: evaluate on folders named as the run's classes, or use "
        '--mode fewshot')
  return [recorded.index(n) for n in names]


def _fewshot_rows(flags_, model, params, config, datasets, train_split, eval_split, shots, seeds,
                  batch_size):
  """Table rows: each dataset's k-shot accuracy, then the mean over datasets if several."""
  # pylint: disable=g-import-not-at-top  (loaded by run)
  from vit_jax import evaluate
  from vit_jax import input_pipeline
  # pylint: enable=g-import-not-at-top
  standardise = getattr(flags_, 'standardise', _DEFAULTS.fewshot_standardise)
  results, rows = {}, []
  for dataset, label in zip(datasets, config_checks.dataset_labels(datasets)):
    cfg = evaluate.data_config(config, dataset=dataset, split=eval_split)
    num_classes = input_pipeline.get_info(cfg).num_classes
    train_x, train_y = evaluate.extract_features(model, params, cfg, train_split, batch_size)
    fit, skipped = _shots_that_fit(flags_, shots, train_y, cfg, train_split, label)
    test_x, test_y = evaluate.extract_features(model, params, cfg, eval_split, batch_size)
    results[label] = evaluate.fewshot_accuracy(train_x, train_y, test_x, test_y, num_classes, fit,
                                               seeds, flags_.l2_reg, standardise=standardise)
    for k, r in results[label].items():
      if len(seeds) == 1:  # no spread to show
        value = f'{r["mean"]:.4f}  (seed {seeds[0]})'
      else:
        per_seed = ' '.join(f'{a:.4f}' for a in r['per_seed'])
        value = (f'{r["mean"]:.4f} ± {r["std"]:.4f}  (seeds {",".join(map(str, seeds))}: '
                 f'{per_seed})')
      rows.append(('fewshot', f'{label} {k}-shot', value))
    rows += [('fewshot', f'{label} {k}-shot', f'skipped: {why}') for k, why in skipped]
  if len(results) > 1:
    rows += [('fewshot', f'mean {k}-shot', f'{acc:.4f}  (over {len(results)} datasets)')
             for k, acc in evaluate.mean_over_datasets(results).items()]
  return rows


def _whole_numbers(flags_, name, minimum):
  """The comma-separated whole numbers of flag `name`, each >= minimum (one line if not)."""
  values = list(getattr(flags_, name))
  try:
    numbers = [int(v) for v in values]
  except ValueError:
    numbers = []
  if not numbers or min(numbers) < minimum:
    raise ValueError(f'--{name}={",".join(values)}: expected whole numbers >= {minimum}, '
                     f'comma-separated: e.g. --{name}=1,5')
  twice = [n for i, n in enumerate(numbers) if n in numbers[:i]]
  if twice:  # one draw scored twice had read as a spread of 0; one k as a single row
    raise ValueError(f'--{name}={",".join(values)} gives {twice[0]} twice: give each once')
  return numbers


def _shots_that_fit(flags_, shots, train_y, cfg, train_split, label):
  """(the shots the k-shot pool holds for every class, [(k, why) skipped]).

  The default shots (1, 5, 10, 25) that a small pool cannot draw are skipped with their
  reason, so that a small folder still gets its other rows; shots typed on the command
  line that it cannot draw stop the evaluation, before the held-out features.
  """
  # pylint: disable=g-import-not-at-top  (loaded by run)
  from vit_jax import evaluate
  from vit_jax import input_pipeline
  # pylint: enable=g-import-not-at-top
  if not len(train_y):
    raise ValueError(f'{label} split {train_split!r} holds no images for the k-shot draws: '
                     'use another --train_split')
  c, n = evaluate.smallest_class(train_y)
  names = input_pipeline.class_names(cfg)
  why = (f'class {c}{f" ({names[c]})" if c < len(names) else ""} has '
         f'{errors.count_of(n, f"{train_split} image")}')
  fit = [k for k in shots if k <= n]
  typed = _typed(flags_, 'shots')
  if len(fit) < len(shots) and (typed or not fit):
    raise ValueError(f'{label}: {why}, fewer than {max(shots)} shots: use '
                     f'--shots={",".join(map(str, fit or [n]))} or a larger --train_split')
  return fit, [(k, f'{why}, fewer than {k}') for k in shots if k > n]


def _fewshot_datasets(flags_):
  """--fewshot_datasets as a list (None: not given); an empty name is refused."""
  names = getattr(flags_, 'fewshot_datasets', None)
  if names is not None and (not names or not all(n.strip() for n in names)):
    raise ValueError(f'--fewshot_datasets={",".join(names)}: a dataset name is empty: e.g. '
                     '--fewshot_datasets=cifar100,oxford_iiit_pet')
  twice = [n for i, n in enumerate(names or ()) if n in names[:i]]
  if twice:  # one row, and the mean over datasets, would have counted it once
    raise ValueError(f'--fewshot_datasets names {twice[0]} twice: list each dataset once')
  return names


# The flags only the k-shot evaluation reads.
_FEWSHOT_FLAGS = ('train_split', 'fewshot_datasets', 'shots', 'seeds', 'standardise', 'l2_reg')


def _typed(flags_, name, unknown=True):
  """Whether flag `name` was given on the command line (a plain namespace: `unknown`)."""
  try:
    return flags_[name].present
  except (TypeError, KeyError):
    return unknown


def main(argv):
  cli_help.refuse_arguments('vit-evaluate', argv, "a run's folder is --workdir=DIR")
  try:
    print(run(flags.FLAGS))
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f'vit-evaluate: {_own_flags(str(e))}')


def _own_flags(message):
  """The shared code names vit-train's --config.x; where vit-evaluate has --x, that one."""
  return re.sub(r'--config\.(\w+)', lambda m: f'--{m.group(1)}'
                if m.group(1) in flags.FLAGS else m.group(0), message)


def run_cli():
  """The `vit-evaluate` console script."""
  _define_flags()
  cli_help.run(main, __name__, model_flags.__name__, program='vit-evaluate')


if __name__ == '__main__':
  run_cli()
