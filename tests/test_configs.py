"""Tests of configs/: every Table 3 and Table 4 row against the paper's values written out here."""
from absl import flags
from ml_collections import config_flags
import pytest

from vit_jax import configs
from vit_jax import optim

from vit_jax.configs import finetune as FINETUNE
from vit_jax.configs import pretrain as PRETRAIN
from vit_jax.configs import quickstart as QUICKSTART

# Table 3 of the paper, one line per model: (model, dataset, epochs, base LR, LR decay, weight decay, dropout).
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
] + [(m, 'imagenet2012', (300,), 3e-3, 'cosine', 0.3, 0.1)  # "ViT-*".
     for m in ('ViT-B_16', 'ViT-B_32', 'ViT-L_16', 'ViT-L_32', 'ViT-H_14', 'ViT-S_16', 'ViT-Ti_16')]

# (TFDS name, training images) per pre-training dataset.
PRETRAIN_DATA = {
    'jft300m': ('jft', 303_000_000),
    'imagenet21k': ('imagenet21k', 14_197_122),
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
      assert (c.loss, c.head_bias_init, c.end_lr, c.grad_clip_norm) == (
          'softmax_xent', 0.0, 0.0, 1.0)
    else:  # The published ImageNet-21k recipe; clipping is ImageNet-only in B.1.
      assert (c.loss, c.head_bias_init, c.end_lr, c.grad_clip_norm) == (
          'sigmoid_xent', -10.0, 1e-5, 0.0)
    optim.validate(c)


def test_pretrain_total_steps_example():
  c = PRETRAIN.get_config('ViT-L_16,jft300m')
  assert optim.total_steps(c) == 517_823  # ceil(7 * 303e6 / 4096 = 517822.27).
  c = PRETRAIN.get_config('ViT-L_16,jft300m,14')
  assert optim.total_steps(c) == 1_035_645  # ceil(1035644.53).


@pytest.mark.parametrize('arg', [
    None, '', 'ViT-B_16', 'ViT-B_16,foo', 'R200x3,jft300m', 'ViT-H_14,imagenet21k',
    'R50x1,imagenet2012', 'ViT-B_16,jft300m,14', 'ViT-L_16,jft300m,ten', 'a,b,c,d'])
def test_pretrain_bad_row(arg):
  with pytest.raises(ValueError) as e:
    PRETRAIN.get_config(arg)
  msg = str(e.value)
  assert '\n' not in msg
  if arg and arg.count(',') == 1:
    assert 'ViT-B_16,jft300m' in msg and 'ViT-*,imagenet2012' in msg  # Lists the rows.


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
    'caltech101': ('caltech101', 102), 'cifar100': ('cifar100', 100), 'dtd': ('dtd', 47),
    'oxford_flowers102': ('oxford_flowers102', 102), 'oxford_iiit_pet': ('oxford_iiit_pet', 37),
    'sun397': ('sun397', 397), 'svhn': ('svhn_cropped', 10),
    'patch_camelyon': ('patch_camelyon', 2), 'eurosat': ('eurosat/rgb', 10),
    'resisc45': ('resisc45', 45),
    'diabetic_retinopathy': ('diabetic_retinopathy_detection/btgraham-300', 5),
    'clevr_count': ('clevr', 8), 'clevr_distance': ('clevr', 6), 'dmlab': ('dmlab', 6),
    'dsprites_location': ('dsprites', 16), 'dsprites_orientation': ('dsprites', 16),
    'kitti_distance': ('kitti', 4), 'smallnorb_azimuth': ('smallnorb', 18),
    'smallnorb_elevation': ('smallnorb', 9),
}


def _check_finetune_common(c, model, steps, grid):
  assert c.model_name == model
  assert (c.batch_size, c.optimizer, c.momentum, c.lr_decay) == (512, 'sgd', 0.9, 'cosine')
  assert (c.weight_decay, c.grad_clip_norm, c.image_size, c.end_lr) == (0.0, 1.0, 384, 0.0)
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


@pytest.mark.parametrize('arg', [None, 'ViT-B_16', 'ViT-B_16,foo', 'ViT-B_16,vtab/foo',
                                 'ViT-B_16,cifar10,test', ',cifar10'])
def test_finetune_bad_row(arg):
  with pytest.raises(ValueError) as e:
    FINETUNE.get_config(arg)
  msg = str(e.value)
  assert '\n' not in msg and 'cifar10' in msg and 'vtab/dmlab' in msg


def test_quickstart_loads():
  c = QUICKSTART.get_config()
  assert (c.dataset, c.image_size, c.model_name) == ('fashion_mnist_local', 28, 'ViT-Ti_16')
  assert c.image_size % c.model.patch_size == 0
  assert c.model.hidden_size % c.model.num_heads == 0
  assert c.optimizer == 'adam' and c.lr_decay == 'cosine'
  optim.validate(c)
  with pytest.raises(ValueError, match='no argument'):
    QUICKSTART.get_config('x')


def _parse(argv):
  """Parses argv as main.py would (config_flags reads overrides from the argv it is given)."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, 'config file', flag_values=fv, sys_argv=argv)
  fv(argv)
  return fv.config


def test_command_line_overrides():
  c = _parse([
      'prog', f'--config={configs.resolve("pretrain:ViT-L_16,imagenet21k,30")}',
      '--config.base_lr=0.002', '--config.weight_decay=0',  # int literal into a float field.
      '--config.num_epochs=10', '--config.model.dropout_rate=0', '--config.grad_clip_norm=1',
      '--config.lr_decay=cosine', '--config.end_lr=0',
  ])
  assert c.num_epochs == 10.0 and isinstance(c.num_epochs, float)
  assert (c.base_lr, c.weight_decay, c.model.dropout_rate) == (0.002, 0.0, 0.0)
  assert (c.grad_clip_norm, c.lr_decay) == (1.0, 'cosine')
  optim.validate(c)

  c = _parse(['prog', f'--config={configs.resolve("finetune:ViT-B_16,cifar10")}',
              '--config.base_lr=0.03', '--config.lr_grid=(0.01,0.03)',
              '--config.total_steps=500'])
  assert c.base_lr == 0.03 and tuple(c.lr_grid) == (0.01, 0.03) and c.total_steps == 500
