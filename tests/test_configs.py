"""Tests of configs/: every Table 3 and Table 4 row against the paper's values written out
here, and every row started (config checks, model, optimizer, position embeddings) for every
model it names, as shapes only (jax.eval_shape: no parameters are made)."""
import functools
import os
import re
import subprocess
import sys

from absl import flags
import flax
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
import pytest

from tests.conftest import console_script
from vit_jax import checkpoint
from vit_jax import config_checks
from vit_jax import configs
from vit_jax import models
from vit_jax import optim
from vit_jax import train

from vit_jax.configs import finetune as FINETUNE
from vit_jax.configs import pretrain as PRETRAIN
from vit_jax.configs import quickstart as QUICKSTART

# Table 3 of the paper, one line per model:
# (model, dataset, epochs, base LR, LR decay, weight decay, dropout).
TABLE3 = [
    ('ViT-B_16', 'jft300m', (7,), 8e-4, 'linear', 0.1, 0.0),
    ('ViT-B_32', 'jft300m', (7,), 8e-4, 'linear', 0.1, 0.0),
    ('ViT-L_32', 'jft300m', (7,), 6e-4, 'linear', 0.1, 0.0),
    ('ViT-L_16', 'jft300m', (7, 14), 4e-4, 'linear', 0.1, 0.0),
    ('ViT-H_14', 'jft300m', (14,), 3e-4, 'linear', 0.1, 0.0),
    ('R50x1', 'jft300m', (7,), 1e-3, 'linear', 0.1, 0.0),
    ('R50x2', 'jft300m', (7,), 1e-3, 'linear', 0.1, 0.0),
    ('R101x1', 'jft300m', (7,), 8e-4, 'linear', 0.1, 0.0),
    ('R152x1', 'jft300m', (7,), 6e-4, 'linear', 0.1, 0.0),
    ('R152x2', 'jft300m', (7, 14), 6e-4, 'linear', 0.1, 0.0),  # 14 epochs: Table 6.
    ('R50+ViT-B_16', 'jft300m', (7,), 8e-4, 'linear', 0.1, 0.0),
    ('R50+ViT-B_32', 'jft300m', (7,), 8e-4, 'linear', 0.1, 0.0),
    ('R50+ViT-L_32', 'jft300m', (7,), 2e-4, 'linear', 0.1, 0.0),
    ('R50+ViT-L_16', 'jft300m', (7, 14), 4e-4, 'linear', 0.1, 0.0),
    ('ViT-B_16', 'imagenet21k', (90,), 1e-3, 'linear', 0.03, 0.1),
    ('ViT-B_32', 'imagenet21k', (90,), 1e-3, 'linear', 0.03, 0.1),
    ('ViT-L_16', 'imagenet21k', (90, 30), 1e-3, 'linear', 0.03, 0.1),
    ('ViT-L_32', 'imagenet21k', (90, 30), 1e-3, 'linear', 0.03, 0.1),
] + [
    (m, 'imagenet2012', (300,), 3e-3, 'cosine', 0.3, 0.1)  # "ViT-*".
    for m in ('ViT-B_16', 'ViT-B_32', 'ViT-L_16', 'ViT-L_32', 'ViT-H_14', 'ViT-S_16', 'ViT-Ti_16')
]

# (TFDS name, training images) per pre-training dataset.
PRETRAIN_DATA = {
    'jft300m': ('jft', 303_000_000),
    'imagenet21k': ('imagenet21k', 12_400_000),  # De-duplicated (issue #28), not 14.2M.
    'imagenet2012': ('imagenet2012', 1_281_167),
}
HIDDEN = {'Ti': 192, 'S': 384, 'B': 768, 'L': 1024, 'H': 1280}


def _steps(epochs, n, batch):
  return -(-epochs * n // batch)  # Integer ceil.


@pytest.mark.parametrize('model,dataset,epochs,base_lr,decay,wd,dropout', TABLE3)
def test_pretrain_row(model, dataset, epochs, base_lr, decay, wd, dropout):
  args = [(f'{model},{dataset}', epochs[0])] + [(f'{model},{dataset},{e}', e) for e in epochs]
  tfds_name, n = PRETRAIN_DATA[dataset]
  for arg, e in args:
    c = PRETRAIN.get_config(arg)
    assert c.model_name == model
    assert (c.dataset, c.num_train_examples, c.image_size) == (tfds_name, n, 224)
    assert (c.batch_size, c.warmup_steps, c.optimizer) == (4096, 10_000, 'adam')
    assert (c.adam_b1, c.adam_b2) == (0.9, 0.999)
    assert c.base_lr == pytest.approx(base_lr) and c.lr_decay == decay
    assert c.weight_decay == pytest.approx(wd)
    assert c.num_epochs == e and c.total_steps == -1
    assert optim.total_steps(c) == _steps(e, n, 4096)
    if 'ViT' in model:
      assert c.model.dropout_rate == dropout
      assert c.model.representation_size == HIDDEN[model.split('ViT-')[1].split('_')[0]]
    else:  # BiT ResNets: no dropout or pre-logits layers.
      assert 'dropout_rate' not in c.model and 'representation_size' not in c.model
    if dataset == 'imagenet2012':
      assert (c.loss, c.head_bias_init, c.end_lr, c.grad_clip_norm) == ('softmax_xent', 0.0, 0.0,
                                                                        1.0)
    else:  # The published ImageNet-21k recipe; clipping is ImageNet-only in B.1.
      assert (c.loss, c.head_bias_init, c.end_lr, c.grad_clip_norm) == ('sigmoid_xent', -10.0, 1e-5,
                                                                        0.0)
    optim.validate(c)


def test_pretrain_total_steps_example():
  c = PRETRAIN.get_config('ViT-L_16,jft300m')
  assert optim.total_steps(c) == 517_823  # ceil(7 * 303e6 / 4096 = 517822.27).
  c = PRETRAIN.get_config('ViT-L_16,jft300m,14')
  assert optim.total_steps(c) == 1_035_645  # ceil(1035644.53).


@pytest.mark.parametrize('arg', [
    None, '', 'ViT-B_16', 'ViT-B_16,foo', 'R200x3,jft300m', 'ViT-H_14,imagenet21k',
    'R50x1,imagenet2012', 'ViT-B_16,jft300m,14', 'ViT-L_16,jft300m,ten', 'a,b,c,d',
    'ViT-*,imagenet2012', 'ViT-B_10,imagenet2012', 'ViT-X_16,imagenet2012'
])
def test_pretrain_bad_row(arg):
  with pytest.raises(ValueError) as e:
    PRETRAIN.get_config(arg)
  msg = str(e.value)
  assert '\n' not in msg
  if arg and arg.count(',') == 1:  # Lists the rows, the ViT-* row as a name pattern.
    assert 'ViT-B_16,jft300m' in msg and 'ViT-<Ti|S|B|L|H>_<8|14|16|32>,imagenet2012' in msg
    assert 'ViT-*' not in msg.split('use ', 1)[1]


def test_pretrain_rows_are_table3():
  assert sorted(PRETRAIN.rows()) == sorted(
      (m, d) for m, d, *_ in TABLE3 if m not in ('ViT-S_16', 'ViT-Ti_16'))
  # Every model the usage text shows, as written, is accepted.
  for m, d in PRETRAIN.rows():
    assert PRETRAIN.get_config(f'{m},{d}').model_name == m


# Table 4 of the paper: dataset -> (steps, LR grid); VTAB-1k tasks: 2500 steps, LR 0.01.
TABLE4 = {
    'imagenet2012': (20_000, (0.003, 0.01, 0.03, 0.06)),
    'cifar100': (10_000, (0.001, 0.003, 0.01, 0.03)),
    'cifar10': (10_000, (0.001, 0.003, 0.01, 0.03)),
    'oxford_iiit_pet': (500, (0.001, 0.003, 0.01, 0.03)),
    'oxford_flowers102': (500, (0.001, 0.003, 0.01, 0.03)),
}
# Final (train, test) and dev (train, eval) splits: the paper's 1% / 2% / 10% sub-splits.
TABLE4_SPLITS = {
    'imagenet2012': ('train', 'validation', 'train[:99%]', 'train[99%:]'),
    'cifar100': ('train', 'test', 'train[:98%]', 'train[98%:]'),
    'cifar10': ('train', 'test', 'train[:98%]', 'train[98%:]'),
    'oxford_iiit_pet': ('train', 'test', 'train[:90%]', 'train[90%:]'),
    'oxford_flowers102': ('train', 'test', 'train[:90%]', 'train[90%:]'),
}
# The 19 VTAB-1k tasks: (TFDS name, classes).
VTAB = {
    'caltech101': ('caltech101', 102),
    'cifar100': ('cifar100', 100),
    'dtd': ('dtd', 47),
    'oxford_flowers102': ('oxford_flowers102', 102),
    'oxford_iiit_pet': ('oxford_iiit_pet', 37),
    'sun397': ('sun397', 397),
    'svhn': ('svhn_cropped', 10),
    'patch_camelyon': ('patch_camelyon', 2),
    'eurosat': ('eurosat/rgb', 10),
    'resisc45': ('resisc45', 45),
    'diabetic_retinopathy': ('diabetic_retinopathy_detection/btgraham-300', 5),
    'clevr_count': ('clevr', 8),
    'clevr_distance': ('clevr', 6),
    'dmlab': ('dmlab', 6),
    'dsprites_location': ('dsprites', 16),
    'dsprites_orientation': ('dsprites', 16),
    'kitti_distance': ('kitti', 4),
    'smallnorb_azimuth': ('smallnorb', 18),
    'smallnorb_elevation': ('smallnorb', 9),
}


def _check_finetune_common(c, model, steps, grid):
  assert c.model_name == model
  assert (c.batch_size, c.optimizer, c.momentum, c.lr_decay) == (512, 'sgd', 0.9, 'cosine')
  assert (c.weight_decay, c.grad_clip_norm, c.end_lr) == (0.0, 1.0, 0.0)
  assert c.image_size == 384 or '_14' in model  # Table 4; /14: test_finetune_resolution.
  assert c.total_steps == steps and optim.total_steps(c) == steps
  assert c.lr_grid == pytest.approx(grid) and c.base_lr in c.lr_grid
  assert 0 < c.warmup_steps < steps
  assert c.loss == 'softmax_xent' and c.head_bias_init == 0.0
  assert c.pretrained_path == f'gs://vit_models/imagenet21k/{model}.npz'
  optim.validate(c)


@pytest.mark.parametrize('dataset', list(TABLE4))
@pytest.mark.parametrize('model', ['ViT-B_16', 'ViT-L_16'])
def test_finetune_row(model, dataset):
  steps, grid = TABLE4[dataset]
  train, test, dev_train, dev_eval = TABLE4_SPLITS[dataset]
  c = FINETUNE.get_config(f'{model},{dataset}')
  _check_finetune_common(c, model, steps, grid)
  assert (c.dataset, c.train_split, c.eval_split) == (dataset, train, test)
  assert c.vtab_task == ''
  d = FINETUNE.get_config(f'{model},{dataset},dev')
  _check_finetune_common(d, model, steps, grid)
  assert (d.train_split, d.eval_split) == (dev_train, dev_eval)


def _slice_size(split):
  """Examples in 'name[a:b]' (absolute indices), e.g. 'train[45000:45200]' -> 200."""
  start, stop = split[split.index('[') + 1:-1].split(':')
  return int(stop) - int(start or 0)


@pytest.mark.parametrize('task', list(VTAB))
def test_finetune_vtab_row(task):
  tfds_name, classes = VTAB[task]
  c = FINETUNE.get_config(f'ViT-B_16,vtab/{task}')
  _check_finetune_common(c, 'ViT-B_16', 2500, (0.01,))
  assert c.base_lr == 0.01
  assert (c.dataset, c.num_classes, c.vtab_task) == (tfds_name, classes, task)
  d = FINETUNE.get_config(f'ViT-B_16,vtab/{task},dev')
  assert d.train_split == 'train[:800]' and _slice_size(d.eval_split) == 200
  assert c.train_split == f'{d.train_split}+{d.eval_split}'  # train800val200.
  assert c.eval_split not in (d.train_split, d.eval_split)


def test_vtab_has_19_tasks():
  assert len(VTAB) == 19 and sorted(r for r in FINETUNE.rows() if r.startswith('vtab/')) == sorted(
      f'vtab/{t}' for t in VTAB)


def test_finetune_no_flip_where_it_changes_the_label():
  for task in ('dsprites_location', 'dsprites_orientation', 'smallnorb_azimuth'):
    assert not FINETUNE.get_config(f'ViT-B_16,vtab/{task}').pp.flip


@pytest.mark.parametrize(
    'arg',
    [None, 'ViT-B_16', 'ViT-B_16,foo', 'ViT-B_16,vtab/foo', 'ViT-B_16,cifar10,test', ',cifar10'])
def test_finetune_bad_row(arg):
  with pytest.raises(ValueError) as e:
    FINETUNE.get_config(arg)
  msg = str(e.value)
  assert '\n' not in msg and 'cifar10' in msg and 'vtab/dmlab' in msg


@pytest.mark.parametrize('name,usage', [('finetune', '--config=finetune:<model>,<dataset>[,dev]'),
                                        ('pretrain', '--config=pretrain:<model>,<dataset>'),
                                        ('table2', '--config=table2:<model>[,dev]'),
                                        ('masked_patches', '--config=masked_patches:<model>,')])
def test_a_packaged_config_without_its_argument_says_what_it_takes(name, usage):
  for spec in (name, f'{name}:', f'{name}: '):
    with pytest.raises(ValueError) as e:
      configs.load(spec)
    assert str(e.value).startswith(f'--config={name} needs an argument: use {usage}'), e.value
    assert '\n' not in str(e.value)


def test_vit_train_with_a_packaged_config_lacking_its_argument(tmp_path):
  """From the shell: one line, exit 1, nothing written."""
  p = console_script('vit-train', tmp_path, '--config=finetune', '--workdir=w')
  assert p.returncode == 1 and os.listdir(tmp_path) == [], p.stderr
  assert p.stderr.strip().splitlines()[-1].startswith(
      'vit-train: --config=finetune needs an argument: use --config=finetune:<model>,<dataset>')


def test_quickstart_loads():
  c = QUICKSTART.get_config()
  assert (c.dataset, c.image_size, c.model_name) == ('fashion_mnist_local', 28, 'ViT-Ti_16')
  assert c.image_size % c.model.patch_size == 0
  assert c.model.hidden_size % c.model.num_heads == 0
  assert c.optimizer == 'adam' and c.lr_decay == 'cosine'
  optim.validate(c)
  with pytest.raises(ValueError, match='no argument'):
    QUICKSTART.get_config('x')
  # Its log lines say the model is smaller than its name: only the changed fields are named.
  assert models.describe(c.model_name, **c.model) == (
      'ViT-Ti_16 with hidden_size=64, mlp_dim=128, num_heads=4, num_layers=4, patch_size=7')
  assert models.describe('ViT-B_16', patch_size=16, dropout_rate=0.0) == 'ViT-B_16'
  assert models.describe('R50+ViT-B_16', resnet_layers=[3, 4, 9]) == 'R50+ViT-B_16'


def _parse(argv):
  """Parses argv as main.py would (config_flags reads overrides from the argv it is given)."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, 'config file', flag_values=fv, sys_argv=argv)
  fv(argv)
  return fv.config


def test_command_line_overrides():
  c = _parse([
      'prog',
      f'--config={configs.resolve("pretrain:ViT-L_16,imagenet21k,30")}',
      '--config.base_lr=0.002',
      '--config.weight_decay=0',  # int literal into a float field.
      '--config.num_epochs=10',
      '--config.model.dropout_rate=0',
      '--config.grad_clip_norm=1',
      '--config.lr_decay=cosine',
      '--config.end_lr=0',
  ])
  assert c.num_epochs == 10.0 and isinstance(c.num_epochs, float)
  assert (c.base_lr, c.weight_decay, c.model.dropout_rate) == (0.002, 0.0, 0.0)
  assert (c.grad_clip_norm, c.lr_decay) == (1.0, 'cosine')
  optim.validate(c)

  c = _parse([
      'prog', f'--config={configs.resolve("finetune:ViT-B_16,cifar10")}', '--config.base_lr=0.03',
      '--config.lr_grid=(0.01,0.03)', '--config.total_steps=500'
  ])
  assert c.base_lr == 0.03 and tuple(c.lr_grid) == (0.01, 0.03) and c.total_steps == 500


# --- Choices settled against the paper and the official repository (finetune.py docstring).


@pytest.mark.parametrize(
    'model,dataset,size',
    [
        ('ViT-B_16', 'cifar10', 384),
        ('ViT-B_32', 'imagenet2012', 384),
        ('ViT-L_16', 'imagenet2012', 384),
        ('R50+ViT-B_16', 'oxford_iiit_pet', 384),
        ('R50x1', 'cifar100', 384),
        ('ViT-B_8', 'cifar10', 384),
        ('ViT-H_14', 'cifar10', 378),
        ('ViT-H_14', 'vtab/dmlab', 378),  # 27 x 14, grid 27 x 27.
        ('ViT-H_14', 'imagenet2012', 378),  # Table 5's protocol (Table 2's 518: table2.py).
    ])
def test_finetune_resolution(model, dataset, size):
  assert FINETUNE.get_config(f'{model},{dataset}').image_size == size
  assert FINETUNE.get_config(f'{model},{dataset},dev').image_size == size


def test_finetune_resolution_fits_every_variant():
  """Every variant tiles every row's image: the resolution follows the model's pixels per
  token (R+ViT-Ti_16: 32, whatever its name says)."""
  for name in models.VARIANTS:
    stride = models.pixels_per_token(models.get_variant(name))
    size = FINETUNE.image_size_for(name)
    assert size % stride == 0 and 384 - stride < size <= 384, (name, size)


@pytest.mark.parametrize('model,dropout', [('ViT-Ti_16', 0.0), ('ViT-S_16', 0.0), ('ViT-B_16', 0.0),
                                           ('ViT-B_32', 0.0), ('ViT-L_32', 0.0), ('ViT-L_16', 0.1),
                                           ('ViT-H_14', 0.1), ('R50+ViT-B_16', 0.1),
                                           ('R50+ViT-L_32', 0.1)])
def test_finetune_dropout_is_the_official_model_configs(model, dropout):
  c = FINETUNE.get_config(f'{model},cifar10')
  assert (c.model.dropout_rate, c.model.attention_dropout_rate) == (dropout, 0.0)


def test_finetune_crops():
  for dataset in TABLE4:  # The official input pipeline's Inception crop, CIFAR included.
    c = FINETUNE.get_config(f'ViT-B_16,{dataset}')
    assert (c.pp.train_crop, c.pp.flip, c.pp.eval_crop) == ('inception', True, 'resize')
  for task in VTAB:  # Whole image: a crop changes counts, positions and distances.
    assert FINETUNE.get_config(f'ViT-B_16,vtab/{task}').pp.train_crop == 'resize'


def test_finetune_bit_paths():
  assert FINETUNE.get_config('R50x1,cifar10').pretrained_path == 'gs://bit_models/BiT-M-R50x1.npz'
  assert FINETUNE.pretrained_path('BiT-M-R50x3') == 'gs://bit_models/BiT-M-R50x3.npz'


# --- Every row started, as shapes: config checks, model init, optimizer init, and for
# fine-tuning the position-embedding interpolation from the 224 pre-training grid.

PRETRAIN_CLASSES = {'jft300m': 18_291, 'imagenet21k': 21_843, 'imagenet2012': 1000}
PRETRAIN_RESOLUTION = 224


@functools.lru_cache(maxsize=None)
def _trunk_shapes(model_name, image_size, overrides, head_bias_init, num_classes):
  """Parameter shapes of a model traced once per (model, resolution, overrides)."""
  config = PRETRAIN.common.get_config()
  config.model_name, config.head_bias_init = model_name, head_bias_init
  config.model.update(dict(overrides))
  model = train.build_model(config, num_classes)
  images = jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32)
  variables = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x, train=False), images)
  return variables['params']


_TRUNKS = {}  # (model, resolution, overrides, head bias) -> num_classes of the trace.


def _param_shapes(c, num_classes):
  """The row's parameter shapes. Tracing dominates this file's run time and is per
  module, so one trace (model.init under jax.eval_shape at the row's resolution) serves
  every row of the same model, resolution and overrides; rows with another class count
  differ only in the head, whose (D, K) kernel and (K,) bias are set here."""
  key = (c.model_name, c.image_size, tuple(sorted(c.model.to_dict().items())), c.head_bias_init)
  traced_classes = _TRUNKS.setdefault(key, num_classes)
  params = _trunk_shapes(*key, traced_classes)
  head = params['head']
  assert head['kernel'].shape[-1] == head['bias'].shape[-1] == traced_classes
  assert train.build_model(c, num_classes).num_classes == num_classes
  if traced_classes != num_classes:
    params = dict(
        params, head={
            'kernel': jax.ShapeDtypeStruct(head['kernel'].shape[:-1] + (num_classes,), jnp.float32),
            'bias': jax.ShapeDtypeStruct((num_classes,), jnp.float32)
        })
  return params, key + (num_classes,)


_OPTIMIZER_FIELDS = ('optimizer', 'adam_b1', 'adam_b2', 'momentum', 'weight_decay',
                     'grad_clip_norm', 'base_lr', 'lr_decay', 'end_lr', 'warmup_steps')
_OPT_STATES = {}


def _start(c, num_classes, num_train_examples=None):
  """What train_and_evaluate does before its first step, as shapes; returns the params.

  A row's 'dev' twin (other splits only) reuses its optimizer-state trace.
  """
  config_checks.validate_config(c, num_train_examples)
  params, params_key = _param_shapes(c, num_classes)
  assert params['head']['kernel'].shape[-1] == num_classes
  steps = optim.total_steps(c, num_train_examples)
  assert 0 < c.warmup_steps < steps
  opt_key = (params_key, tuple((f, c[f]) for f in _OPTIMIZER_FIELDS), steps)
  if opt_key not in _OPT_STATES:
    _OPT_STATES[opt_key] = jax.eval_shape(optim.make_optimizer(c, steps).init, params)
  opt_state = _OPT_STATES[opt_key]
  assert len(jax.tree_util.tree_leaves(opt_state)) >= len(jax.tree_util.tree_leaves(params))
  return params


@functools.lru_cache(maxsize=None)
def _interpolated_shape(num_pretrained, num_tokens, width, has_cls):
  pretrained = np.zeros((1, num_pretrained, width), np.float32)
  return checkpoint.interpolate_posemb(pretrained, num_tokens, has_cls).shape


def _check_posemb(c, params):
  """The 224 pre-training grid of the published checkpoint interpolates onto this row's."""
  flat = flax.traverse_util.flatten_dict(params, sep='/')
  keys = [k for k in flat if k.endswith('pos_embedding')]
  if not keys:  # BiT ResNets: no position embeddings.
    assert 'ViT-' not in c.model_name
    return
  target = flat[keys[0]].shape
  has_cls = 'cls' in flat
  stride = models.pixels_per_token(models.get_variant(c.model_name, **c.model))
  g0, g1 = PRETRAIN_RESOLUTION // stride, c.image_size // stride
  assert target[1] == g1 * g1 + has_cls
  assert _interpolated_shape(g0 * g0 + has_cls, target[1], target[2], has_cls) == target


@pytest.mark.parametrize(
    'model,dataset',
    PRETRAIN.rows() + [('ViT-S_16', 'imagenet2012'), ('ViT-Ti_16', 'imagenet2012')])
def test_pretrain_row_starts(model, dataset):
  epochs = next(row.epochs for row in PRETRAIN.TABLE3
                if row.dataset == dataset and (model in row.models or row.models == ('ViT-*',)))
  for arg in [f'{model},{dataset}'] + [f'{model},{dataset},{e}' for e in epochs]:
    c = PRETRAIN.get_config(arg)
    assert c.image_size == PRETRAIN_RESOLUTION
    _start(c, PRETRAIN_CLASSES[dataset])


@pytest.mark.parametrize('dataset', list(TABLE4))
@pytest.mark.parametrize('model', FINETUNE.MODELS)
def test_finetune_row_starts(model, dataset):
  for arg in (f'{model},{dataset}', f'{model},{dataset},dev'):
    c = FINETUNE.get_config(arg)
    _check_posemb(c, _start(c, c.num_classes))


@pytest.mark.parametrize('task', list(VTAB))
@pytest.mark.parametrize('model', FINETUNE.MODELS)
def test_finetune_vtab_row_starts(model, task):
  for arg in (f'{model},vtab/{task}', f'{model},vtab/{task},dev'):
    c = FINETUNE.get_config(arg)
    _check_posemb(c, _start(c, c.num_classes))


@pytest.mark.parametrize('model,size', [('ViT-L_16', 512), ('ViT-H_14', 518)])
def test_table2_row_starts(model, size):
  """Table 2's ImageNet recipe (B.1.1): Table 4's ImageNet row at 512 / 518 with Polyak
  averaging 0.9999 and ReaL; 'dev' chooses base_lr without looking at ReaL."""
  c = configs.load(f'table2:{model}')
  assert (c.image_size, c.polyak_decay, c.eval_real) == (size, 0.9999, True)
  table4 = FINETUNE.get_config(f'{model},imagenet2012')
  differ = {k for k, v in c.items() if table4[k] != v}
  assert differ - {'image_size'} == {'polyak_decay', 'eval_real'}  # (H/14 is at 518 there too)
  _check_posemb(c, _start(c, 1000))
  dev = configs.load(f'table2:{model},dev')
  assert (dev.train_split, dev.eval_split, dev.eval_real) == ('train[:99%]', 'train[99%:]', False)
  with pytest.raises(ValueError, match='use --config=table2:<model>'):
    configs.load('table2:ViT-B_16')


@pytest.mark.parametrize('override,hint',
                         [('--config.totl_steps=3', 'total_steps'),
                          ('--config.lr=1e', 'base_lr, end_lr'),
                          ('--config.learning_rate=0.1', 'base_lr'),
                          ('--config.wd=0', 'weight_decay'),
                          ('--config.input.batch_size=8', 'batch_size, dataset, pp')])
def test_an_unknown_field_suggests_the_nearest_names(override, hint):
  """Close spellings, fields a short name ends with (big_vision's `lr` is our base_lr), and
  the names other codebases give our fields (configs.OTHER_NAMES)."""
  with pytest.raises(ValueError, match=rf"no field '\w+' \(did you mean {re.escape(hint)}[,?]"):
    configs.load('quickstart', [override])


@pytest.mark.parametrize('override,message', [
    ('--config.model=ViT-L_16', '--config.model is a group of fields (attention_dropout_rate, '
     'dropout_rate, hidden_size, ...): set one as --config.model.FIELD=VALUE; a model variant '
     'is chosen with --config.model_name=ViT-L_16'),
    ('--config.pp=x', '--config.pp is a group of fields ('),
])
def test_a_value_for_a_group_of_fields_names_its_fields(override, message):
  """absl had said "Failed to parse 'ViT-L_16' as a ConfigDict: ValueError('malformed node
  or string ...')"."""
  with pytest.raises(ValueError) as e:
    configs.load('quickstart', [override])
  assert str(e.value).startswith(message), e.value
  assert configs.load('quickstart', ['--config.model.num_layers=2']).model.num_layers == 2


def test_the_other_codebases_names_lead_to_fields():
  """Every name in configs.OTHER_NAMES is not a field, and every name it suggests is one."""
  fields = set(configs.load('quickstart'))
  assert not set(configs.OTHER_NAMES) & fields
  assert {f for names in configs.OTHER_NAMES.values() for f in names} <= fields


def test_a_value_of_the_wrong_type_is_in_plain_words():
  with pytest.raises(ValueError, match=r'^flag --config.total_steps=abc: expected an integer$'):
    configs.load('quickstart', ['--config.total_steps=abc'])


def test_every_field_of_the_variant_is_a_model_override():
  """--config.model.X takes the variant's fields the config does not list (the finetune
  config lists the dropout rates only), typed as the variant's values; the variant of an
  overridden model_name decides, wherever that flag stands."""
  c = configs.load('finetune:ViT-B_16,cifar10', [
      '--config.model.num_layers=1', '--config.model.representation_size=16',
      '--config.model.classifier=gap', '--config.model.attention_dropout_rate=0',
      '--config.model.dropout_rate=0.2', '--config.base_lr=0.1'
  ])
  assert dict(c.model) == dict(num_layers=1, representation_size=16, classifier='gap',
                               dropout_rate=0.2, attention_dropout_rate=0.0)
  assert type(c.model.attention_dropout_rate) is float and c.base_lr == 0.1 and c.is_locked
  assert models.describe(c.model_name, **c.model) == (
      'ViT-B_16 with classifier=gap, dropout_rate=0.2, num_layers=1, representation_size=16')
  for args in (['--config.model.resnet_layers=(2,2)', '--config.model_name=R50+ViT-B_16'],
               ['--config.model_name', 'R50+ViT-B_16', '--config.model.resnet_layers', '2,2']):
    c = configs.load('finetune:ViT-B_16,cifar10', args)
    assert (c.model_name, c.model.resnet_layers) == ('R50+ViT-B_16', (2, 2))
  c = configs.load('finetune:R50+ViT-B_16,cifar10', ['--config.model.representation_size=None'])
  assert c.model.representation_size is None and c.model.dropout_rate == 0.1


@pytest.mark.parametrize(
    'spec,override,message',
    [
        ('finetune:ViT-B_16,cifar10', '--config.model.num_layer=2',
         "--config.model.num_layer: model ViT-B_16 has no field 'num_layer' (did you mean "
         'num_layers, resnet_layers?); its fields: attention_dropout_rate, classifier, '),
        ('finetune:R50x1,cifar10', '--config.model.num_layers=2',
         "--config.model.num_layers: model R50x1 has no field 'num_layers' (did you mean "
         'resnet_layers?); its fields: resnet_layers, resnet_width'),
        ('finetune:ViT-B_16,cifar10', '--config.model.num_layers=2.5',
         'flag --config.model.num_layers=2.5: expected an integer'),
        ('finetune:ViT-B_16,cifar10', '--config.model.num_layers=True',
         'flag --config.model.num_layers=True: expected an integer'),
        ('finetune:ViT-B_16,cifar10', '--config.model.resnet_layers=3',
         'flag --config.model.resnet_layers=3: expected a tuple of integers such as (3,4,9) or None'
        ),
        ('finetune:ViT-B_16,cifar10', '--config.model.dropout_rate=x',
         'flag --config.model.dropout_rate=x: expected a number'),
        # A value of the right type: the config checks' to refuse.
        ('finetune:ViT-B_16,cifar10', '--config.model.classifier=GAP',
         'classifier \'GAP\' is not supported: set --config.model.classifier to "token" or "gap"'),
    ])
def test_a_bad_model_override_is_one_line(spec, override, message):
  with pytest.raises(ValueError) as e:
    config_checks.validate_before_devices(configs.load(spec, [override]))
  assert str(e.value).startswith(message) and '\n' not in str(e.value), e.value


def test_a_model_of_another_family_than_the_config_s_is_one_line():
  """The quickstart sets ViT fields in config.model; a ResNet has none of them."""
  config = configs.load('quickstart', ['--config.model_name=R50x1'])
  with pytest.raises(ValueError) as e:
    config_checks.validate_before_devices(config)
  assert str(e.value) == (
      'model_name R50x1 (bit family) has no field attention_dropout_rate, dropout_rate, '
      'hidden_size, mlp_dim, num_heads, num_layers, patch_size, which the config sets in '
      'config.model for another model: start from a config for R50x1 (e.g. '
      '--config=finetune:R50x1,<dataset>) or one of your own')


@pytest.mark.parametrize(
    'overrides,message',
    [
        (['--config.total_steps=2', '--config.seed=1', '--config.total_steps', '3'
         ], "--config.total_steps is given more than once ('2', '3'): give one"),
        (['--config.fsdp', '--noconfig.fsdp'], "--config.fsdp is given more than once ('True', "
         "'False'): give one"),
        # A variant field the config does not list (split off before the config is parsed).
        (['--config.model.representation_size=8', '--config.model.representation_size=9'
         ], "--config.model.representation_size is given more than once ('8', '9'): give one"),
    ])
def test_a_config_field_given_twice_is_refused(tmp_path, overrides, message):
  """ml_collections took the last value, silently."""
  with pytest.raises(ValueError) as e:
    configs.load('quickstart', overrides)
  assert str(e.value) == message
  proc = subprocess.run(
      [sys.executable, '-m', 'vit_jax.main', '--config=quickstart', '--workdir=w', *overrides],
      cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert (proc.returncode, proc.stderr) == (1, f'vit-train: {message} (see --help)\n')
  assert os.listdir(tmp_path) == []
  assert configs.load('quickstart', ['--config.total_steps=2', '--config.seed=2']).seed == 2


def test_a_model_name_that_would_change_only_the_name_is_refused(tmp_path):
  """The quickstart sets every size of its ViT in config.model: with --config.model_name=
  ViT-L_16 it had trained its 4-layer model under that name."""
  message = ('--config.model_name=ViT-L_16 changes only the name: the config sets '
             'model.hidden_size, model.mlp_dim, model.num_heads, model.num_layers, every field '
             'where ViT-L_16 differs from ViT-Ti_16: set them too (--config.model.FIELD=VALUE), '
             'or start from a config for ViT-L_16 (e.g. --config=finetune:ViT-L_16,<dataset>)')
  with pytest.raises(ValueError) as e:
    configs.load('quickstart', ['--config.model_name=ViT-L_16'])
  assert str(e.value) == message
  proc = subprocess.run([
      sys.executable, '-m', 'vit_jax.main', '--config=quickstart', '--workdir=w',
      '--config.model_name', 'ViT-L_16'
  ], cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert (proc.returncode, proc.stderr) == (1, f'vit-train: {message} (see --help)\n')
  # Where the name does change the model, it is taken: all of ViT-L's sizes given, or a
  # hybrid's ResNet stem, which the quickstart does not set.
  sizes = dict(hidden_size=1024, mlp_dim=4096, num_heads=16, num_layers=24)
  large = configs.load('quickstart', ['--config.model_name=ViT-L_16']
                       + [f'--config.model.{k}={v}' for k, v in sizes.items()])
  assert large.model_name == 'ViT-L_16' and large.model.num_layers == 24
  assert configs.load('quickstart',
                      ['--config.model_name=R50+ViT-B_16']).model_name == ('R50+ViT-B_16')


def test_vit_train_takes_a_model_field_its_config_does_not_list(tmp_path):
  """From the shell, as the pretrained_keep_prelogits error tells a fine-tuning user to
  do: the field reaches the config checks (here refused there), a misspelt one is refused
  with the variant's fields; one line each, nothing written. --help lists the fields."""
  p = console_script('vit-train', tmp_path, '--config=finetune:ViT-B_16,cifar10', '--workdir=w',
                     '--config.model.representation_size', '0')
  assert p.returncode == 1 and os.listdir(tmp_path) == [], p.stderr
  assert p.stderr.strip().splitlines()[-1] == (
      'vit-train: model.representation_size 0 must be a whole number >= 1: set '
      '--config.model.representation_size'), p.stderr[-2000:]
  p = console_script('vit-train', tmp_path, '--config=finetune:ViT-B_16,cifar10', '--workdir=w',
                     '--config.model.clasifier=gap')
  assert p.returncode == 1 and os.listdir(tmp_path) == [], p.stderr
  assert p.stderr.strip().splitlines()[-1].startswith(
      "vit-train: --config.model.clasifier: model ViT-B_16 has no field 'clasifier' (did you "
      'mean classifier?); its fields: '), p.stderr[-2000:]
  # --help lists them, with the variant's values, after the config's own fields.
  p = console_script('vit-train', tmp_path, '--config=finetune:ViT-B_16,cifar10', '--help')
  listed = p.stdout.split('\n\nThe fields of ViT-B_16 the config leaves to the model (set as '
                          '--config.model.FIELD=VALUE):\n\n')[1].split('\n\n')[0]
  assert listed.splitlines() == [
      'model.classifier: token', 'model.hidden_size: 768', 'model.mlp_dim: 3072',
      'model.num_heads: 12', 'model.num_layers: 12', 'model.patch_size: 16',
      'model.representation_size: None', 'model.resnet_layers: None', 'model.resnet_width: 1'
  ], p.stdout[-3000:]
  assert '\nmodel.dropout_rate: 0.0\n' in p.stdout.split('The fields of ViT-B_16')[0]


_CHECK_BEFORE_DEVICES = '''
import sys
from jax._src import xla_bridge
from vit_jax import config_checks, configs
for spec in sys.argv[1:]:
  config_checks.validate_before_devices(configs.load(spec))
print(xla_bridge.backends_are_initialized(), 'tensorflow' in sys.modules)
'''


def test_packaged_configs_pass_the_checks_before_any_backend_or_tensorflow():
  """vit-train runs these checks before TensorFlow loads and before the backend starts
  (xla_cpu_flags and cpu_devices must come first): they may use neither."""
  specs = [
      'quickstart', 'finetune:ViT-H_14,imagenet2012', 'finetune:R50+ViT-B_16,cifar10',
      'finetune:BiT-M-R50x1,oxford_iiit_pet', 'pretrain:ViT-B_16,imagenet21k', 'table2:ViT-H_14',
      'masked_patches:quickstart', 'masked_patches:ViT-B_16,imagenet2012'
  ]
  proc = subprocess.run([sys.executable, '-c', _CHECK_BEFORE_DEVICES, *specs], capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ['False', 'False'], proc.stdout


def test_vit_train_imports_no_jax_before_it_re_executes():
  """vit-train's first process (before host_allocator re-executes it) imports vit_jax.main
  and nothing heavy: JAX and Flax would be paid for twice. Loading the quickstart config
  with its listed model fields overridden needs them neither."""
  code = ('import sys; from vit_jax import configs, main;'
          "configs.load('quickstart', ['--config.model.num_layers=1', '--config.base_lr=0.1']);"
          "print(sorted(m for m in ('jax', 'flax', 'tensorflow') if m in sys.modules))")
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split() == ['[]'], proc.stdout
