r"""Masked patch prediction in miniature, offline: Fashion-MNIST, the quickstart-sized ViT
on 4x4 patches.

  python experiments/masked_patches_fashion.py --workdir workdirs/mpp_fashion

1. Pre-trains the quickstart model with masked patch prediction (configs/masked_patches.py
   :quickstart, the paper's objective: 50% of the patches corrupted 80/10/10, 3-bit mean
   colour targets) on the 60,000 training images; their labels are never read by the loss.
2. Fine-tunes it with few labels, the first 1% (600) and 10% (6,000) training images, and
   the same fine-tuning from scratch (same config, steps and seeds; only
   --config.pretrained_path differs): Fashion-MNIST test accuracy, mean and std over seeds.
3. 5-shot linear accuracy (vit_jax.evaluate.fewshot_accuracy, closed-form ridge) on
   frozen features of the pre-trained model against the same model at random
   initialisation: the pre-logits (the class token's output, what fine-tuning reads) and
   the mean of the patch tokens' outputs (what the objective trains).

Everything goes through vit_jax.train.train_and_evaluate, as `vit-train` would run it; a
second start reuses what finished (results.json, the runs' final.npz), and refuses a workdir
whose results were made with other step counts, batch, learning rate, few-shot pool or
data (other --labels and --seeds only add runs). Prints a Markdown
table (the README's "Masked patch prediction" section shows one). Sized for ~15 minutes on
2 CPU cores; the step counts and seeds are flags.
"""
import json
import os
import sys
import time

from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from vit_jax import tensorflow_quietly  # noqa: F401  (first: before TensorFlow loads)
from vit_jax import checkpoint
from vit_jax import cli_help
from vit_jax import config_checks
from vit_jax import errors
from vit_jax import evaluate
from vit_jax import input_pipeline
from vit_jax import masked_patches
from vit_jax import train
from vit_jax.configs import masked_patches as mp_configs
from vit_jax.configs import quickstart

flags.DEFINE_string('workdir', 'workdirs/masked_patches_fashion', 'Runs and results.json go here.')
flags.DEFINE_string('data_dir', '', 'Folder of the Fashion-MNIST IDX files ("" = default).')
flags.DEFINE_integer('pretrain_steps', 800, 'Masked patch prediction steps (batch 128).',
                     lower_bound=1)
flags.DEFINE_integer('finetune_steps', 150, 'Fine-tuning steps of every labelled run.',
                     lower_bound=1)
flags.DEFINE_integer('finetune_batch', 64, 'Fine-tuning batch size.', lower_bound=1)
flags.DEFINE_float('finetune_lr', 1e-3, 'Fine-tuning base learning rate (Adam, cosine).',
                   lower_bound=0)
flags.DEFINE_list('labels', ['600', '6000'], 'Labelled training images (first n of train).')
flags.DEFINE_list('seeds', ['0', '1', '2'], 'Fine-tuning seeds.')
flags.DEFINE_integer(
    'fewshot_pool', 2000, 'Training images the 5-shot draws come from (each class needs 5: in '
    'Fashion-MNIST the first 200 hold 16 or more of each).', lower_bound=50)
flags.DEFINE_integer('fewshot_draws', 5, 'Random 5-shot draws (seeds 0..n-1).', lower_bound=1)
FLAGS = flags.FLAGS
TRAIN_IMAGES = 60_000  # Fashion-MNIST's training split


def _whole_numbers(low, high):
  """A flag validator: every item of a list flag a whole number in [low, high]; checked when
  the flags are parsed, not after the pre-training they would have run behind."""
  return lambda items: bool(items) and all(item.strip().isdigit() and low <= int(item) <= high
                                           for item in items)


flags.register_validator('labels', _whole_numbers(1, TRAIN_IMAGES),
                         f'give whole numbers from 1 to {TRAIN_IMAGES:,}, comma-separated')
flags.register_validator('seeds', _whole_numbers(0, 2**31 - 1),
                         'give whole numbers 0 or more, comma-separated')


def pretrain_config():
  c = mp_configs.get_config('quickstart')
  c.total_steps = FLAGS.pretrain_steps
  c.warmup_steps = FLAGS.pretrain_steps // 10  # 0 under 10 steps: it must stay below them
  c.eval_every_steps = c.checkpoint_every_steps = 0  # only at the end
  c.log_every_steps = 100
  if FLAGS.data_dir:
    c.data_dir = FLAGS.data_dir
  return c


def finetune_config(labels, seed, pretrained):
  c = quickstart.get_config()
  c.model = mp_configs.get_config('quickstart').model  # the pre-trained model (its patches)
  c.seed = seed
  c.train_split = f'train[:{labels}]'
  c.shuffle_buffer = labels
  c.batch_size = FLAGS.finetune_batch
  c.total_steps = FLAGS.finetune_steps
  c.warmup_steps = FLAGS.finetune_steps // 10
  c.base_lr = FLAGS.finetune_lr
  c.eval_every_steps = c.checkpoint_every_steps = 0
  c.log_every_steps = 50
  c.pretrained_path = pretrained or ''
  if FLAGS.data_dir:
    c.data_dir = FLAGS.data_dir
  return c


def patch_features(model, params, config, split):
  """(mean over the patch tokens of the final encoder_norm output, labels) of `split`."""

  @jax.jit
  def features(images):
    _, state = model.apply({'params': params}, images, capture_intermediates=lambda m, _:
                           (m.name == 'encoder_norm'), mutable=['intermediates'])
    tokens = state['intermediates']['Transformer']['encoder_norm']['__call__'][0]
    return jnp.mean(tokens[:, 1:], axis=1)  # without the class token

  cfg = evaluate.data_config(config, split=split)
  feats, labels = [], []
  for batch in input_pipeline.eval_batches(cfg, global_batch=1000):
    feats.append(np.asarray(features(batch['image']))[batch['mask']])
    labels.append(batch['label'][batch['mask']])
  return np.concatenate(feats), np.concatenate(labels)


def fewshot(config, params_or_none):
  """5-shot linear accuracy of frozen features (random init when params is None): the
  pre-logits (the class token's output) and the mean of the patch tokens' outputs."""
  model = train.build_model(config, 0)
  if params_or_none is None:
    images = jnp.zeros((1, config.image_size, config.image_size, 3), jnp.float32)
    params = model.init(jax.random.PRNGKey(config.seed), images, train=False)['params']
  else:
    params = checkpoint.load_pretrained(params_or_none, model, 0, config.image_size)
  n = FLAGS.fewshot_pool
  out = {}
  for name, extract in ((
      'class_token', lambda split: evaluate.extract_features(model, params, config, split, 1000)),
                        ('patch_mean', lambda split: patch_features(model, params, config, split))):
    pool_x, pool_y = extract(f'train[:{n}]')
    test_x, test_y = extract('test')
    # Plain ridge on the raw features, as the figures recorded for this experiment were.
    r = evaluate.fewshot_accuracy(pool_x, pool_y, test_x, test_y, 10, shots=(5,),
                                  seeds=tuple(range(FLAGS.fewshot_draws)), standardise=False)[5]
    out[name] = {'mean': r['mean'], 'std': r['std'], 'per_seed': r['per_seed']}
  return out


def _stats(values):
  if len(values) == 1:  # no spread to show
    return f'{100 * values[0]:.1f}'
  return f'{100 * np.mean(values):.1f} ± {100 * np.std(values):.1f}'


def _over(n, what):
  return f'over {n} {what}' + ('s' if n != 1 else '')


def table(results):
  seeds = len(FLAGS.seeds)
  lines = [
      '| labelled images | from scratch | masked patch pre-trained | difference |',
      '|---|---|---|---|'
  ]
  for labels in FLAGS.labels:
    s = [results['finetune'][f'{labels}/scratch/{x}'] for x in FLAGS.seeds]
    m = [results['finetune'][f'{labels}/masked/{x}'] for x in FLAGS.seeds]
    pct = 100 * int(labels) / TRAIN_IMAGES
    lines.append(f'| {labels} ({pct:g}%), test accuracy % {_over(seeds, "seed")} | {_stats(s)} | '
                 f'{_stats(m)} | {100 * (np.mean(m) - np.mean(s)):+.1f} |')
  for name, what in (('class_token', 'the class token (pre-logits)'),
                     ('patch_mean', 'the mean of the patch tokens')):
    f0 = results['fewshot']['random_init'][name]
    f1 = results['fewshot']['masked'][name]
    lines.append(f'| 5-shot linear on frozen features, {what}, % '
                 f'{_over(FLAGS.fewshot_draws, "draw")} | {_stats(f0["per_seed"])} (random init) | '
                 f'{_stats(f1["per_seed"])} '
                 f'| {100 * (f1["mean"] - f0["mean"]):+.1f} |')
  p = results['pretrain']
  lines.append('')
  lines.append(
      f'Pre-training: {p["steps"]} steps of batch 128, masked-patch (3-bit mean '
      f'colour) accuracy on the test images {100 * p["accuracy"]:.1f}% (always predicting the '
      f'most frequent colour class: {100 * p["majority"]:.1f}%); fine-tuning: '
      f'{FLAGS.finetune_steps} steps of batch {FLAGS.finetune_batch}, Adam, base LR '
      f'{FLAGS.finetune_lr:g}, cosine.')
  return '\n'.join(lines)


def _majority_rate(config):
  """Share of the test patches whose colour is the most frequent class: what always
  predicting that class scores. Every patch is counted; the corrupted ones are a uniform
  random subset of them, so this is also their expected share."""
  cfg = config.masked_patches
  counts = np.zeros(2**(3 * int(cfg.bits)))
  for batch in input_pipeline.eval_batches(config, global_batch=1000):
    t = np.asarray(
        masked_patches.targets(batch['image'][batch['mask']], config.model.patch_size, cfg))
    counts += np.bincount(t.ravel(), minlength=len(counts))
  return float(counts.max() / counts.sum())


# The flags every result depends on; --labels and --seeds name the runs, which are kept apart.
_RESULT_FLAGS = ('pretrain_steps', 'finetune_steps', 'finetune_batch', 'finetune_lr',
                 'fewshot_pool', 'fewshot_draws', 'data_dir')


def _check_same_flags(results, path):
  """A second start with another --pretrain_steps (say) had printed the first start's table
  as this one's, exit 0."""
  given = {name: FLAGS[name].value for name in _RESULT_FLAGS}
  recorded = results.setdefault('flags', given)  # a results.json of an older version: as given
  changed = [
      f'--{n}={recorded[n]!r} -> {given[n]!r}' for n in _RESULT_FLAGS
      if n in recorded and recorded[n] != given[n]
  ]
  if changed:
    sys.exit(f'masked_patches_fashion: {path} holds results made with other flags '
             f'({", ".join(changed)}): pass the same flags to reuse them, or another --workdir')


def _check_configs():
  """vit-train's start-up checks of every run's config, before the first run starts (each
  run had checked its own: a fine-tuning refused after the pre-training's minutes)."""
  runs = [('the pre-training', pretrain_config())]
  runs += [
      (f'the fine-tuning on {n} labels', finetune_config(int(n), 0, None)) for n in FLAGS.labels
  ]
  for what, config in runs:
    try:
      config_checks.validate_before_devices(config)
    except ValueError as e:
      sys.exit(f'masked_patches_fashion: {what} is refused: {errors.one_line(e)} (its config is '
               'made from this script\'s flags: see --help)')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  _check_configs()
  os.makedirs(FLAGS.workdir, exist_ok=True)
  path = os.path.join(FLAGS.workdir, 'results.json')
  results = {'finetune': {}}
  if os.path.exists(path):
    with open(path) as f:
      results = json.load(f)
  _check_same_flags(results, path)

  def save():
    with open(path, 'w') as f:
      json.dump(results, f, indent=1)

  t0 = time.time()
  # The randomly initialised model's few-shot accuracy first: it needs no training, and a
  # pool without 5 images of a class is refused before the minutes of training, not after.
  probe = finetune_config(int(FLAGS.labels[0]), 0, None)
  if 'patch_mean' not in results.get('fewshot', {}).get('random_init', {}):
    try:
      random_init = fewshot(probe, None)
    except ValueError as e:
      sys.exit(f'masked_patches_fashion: the 5-shot draws from the first {FLAGS.fewshot_pool} '
               f'training images (--fewshot_pool): {errors.one_line(e)}')
    results['fewshot'] = {'random_init': random_init}
    save()
  pre_dir = os.path.join(FLAGS.workdir, 'pretrain')
  pre = pretrain_config()
  if 'pretrain' not in results:
    r = train.train_and_evaluate(pre, pre_dir)
    results['pretrain'] = {
        'steps': r['step'],
        'accuracy': r['accuracy'],
        'loss': r['loss'],
        'majority': _majority_rate(pre)
    }
    save()
  print(f'pre-training done ({time.time() - t0:.0f} s): {results["pretrain"]}', flush=True)
  final = os.path.join(pre_dir, 'final.npz')

  for labels in FLAGS.labels:
    for init in ('scratch', 'masked'):
      for seed in FLAGS.seeds:
        key = f'{labels}/{init}/{seed}'
        if key in results['finetune']:
          continue
        c = finetune_config(int(labels), int(seed), final if init == 'masked' else None)
        r = train.train_and_evaluate(c, os.path.join(FLAGS.workdir, key.replace('/', '_')))
        results['finetune'][key] = r['accuracy']
        save()
        print(f'{key}: {r["accuracy"]:.4f} ({time.time() - t0:.0f} s)', flush=True)

  if 'patch_mean' not in results['fewshot'].get('masked', {}):
    results['fewshot']['masked'] = fewshot(probe, final)
    save()
  print(f'\nall done in {time.time() - t0:.0f} s\n')
  print(table(results))
  sys.stdout.flush()


if __name__ == '__main__':
  cli_help.run(main, __name__)  # --help exits 0; a mistyped flag is one line
