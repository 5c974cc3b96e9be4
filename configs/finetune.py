r"""Fine-tuning, every row of the paper's Table 4 (Appendix B.1.1).

  --config=finetune:<model>,<dataset>[,dev]
  e.g. finetune:ViT-B_16,cifar10   finetune:ViT-L_16,vtab/dmlab,dev

All rows: SGD momentum 0.9, cosine decay to 0 after a linear warm-up, batch 512,
no weight decay, gradient clipping at global norm 1, softmax cross-entropy, a new
zero-initialised head (no pre-logits: "a single linear layer at fine-tuning time",
Sec. 3.1), position embeddings interpolated from the 224 pre-training grid, and
the published ImageNet-21k checkpoint gs://vit_models/imagenet21k/<model>.npz
(BiT ResNets: gs://bit_models/BiT-M-<model>.npz). MODELS lists the models with
such a checkpoint; tests/test_configs.py starts every row with each of them.
Choices where the paper is silent or terse:
- Resolution (image_size_for). Table 4: "If not mentioned otherwise, fine-tuning
  resolution is 384". 384 is not a multiple of 14, so /14 models (ViT-H/14) use
  378 = 27 x 14, the largest multiple of 14 not above 384: the same 27 x 27 token
  grid, sequence length and compute that the official vision_transformer code
  gets at its crop 384 (its VALID 14x14 patch convolution drops the last 6 pixel
  rows and columns), but with the whole image resized into it instead of cut.
  392 = 28 x 14 would keep every one of 384 pixels at ~9% more compute; we keep
  the published compute. Every row keeps Table 4's resolution, imagenet2012
  included (Table 5's protocol: its caption says its ImageNet results come
  "without additional techniques (Polyak averaging and 512 resolution images)").
  The Table 2 recipe, ViT-H/14 at 518 = 37 x 14 and ViT-L/16 at 512 with Polyak
  averaging 0.9999 (B.1.1), is configs/table2.py.
- Splits. Without 'dev' (the default): train on the whole training set and
  evaluate on the test split, the paper's protocol for final results (ImageNet:
  'validation'). With 'dev': the paper's development protocol for choosing the
  learning rate, "small sub-splits from the training set (10% for Pets and
  Flowers, 2% for CIFAR, 1% ImageNet) as development set", i.e. train on
  train[:98%] and evaluate on train[98%:] for CIFAR. A sweep runs the lr_grid
  with 'dev', then the best base_lr without it.
- VTAB-1k: train on the 800 + 200 examples (train800val200) and test on the
  task's test split; 'dev' trains on train800 and evaluates on val200. The tasks,
  their splits and the 7 derived labels are those of the VTAB task definitions
  (google-research/task_adaptation), kept in vit_jax/vtab.py.
- base_lr (the default of lr_grid): the best value on the development sets for
  an ImageNet-21k ViT-B/32 in big_vision's transfer config: ImageNet 0.03,
  CIFAR-10 0.003, CIFAR-100 0.01, Pets 0.003, Flowers 0.003; VTAB 0.01 (Table 4).
- Warm-up: 500 steps for the 10k and 20k runs (the official repository's
  default), 100 for the 500-step runs, 200 for the 2500-step VTAB runs (20%, 8%).
- Augmentation: Inception crop (random area 5%-100%, as common.py) + flip for
  ImageNet, CIFAR, Pets and Flowers. The paper says only that pre-processing
  follows Kolesnikov et al. (2020) (BiT; Sec. 4.1, B.1.1); the official
  vision_transformer input pipeline applies exactly this crop to every dataset
  it fine-tunes, CIFAR included, and its maintainers state it is what they used
  internally (issue #46). VTAB: whole-image resize (+ flip where it does not change
  the label; not for dSprites position/orientation or smallNORB azimuth): the
  official repository has no VTAB pipeline, and a 5% crop changes the label of
  the structured tasks (object counts, positions, distances).
- Dropout (FINETUNE_DROPOUT). The paper gives no fine-tuning dropout. The
  official repository's model configs, which replicate the paper's fine-tuning
  results with the published checkpoints, use 0.1 for ViT-L/16, ViT-H/14 and the
  R50 hybrids (R50+ViT-B/16; R50+ViT-L/32 inherits L/16's) and 0.0 for ViT-Ti,
  S, B and ViT-L/32 (set to 0 after its README's do=0.0 vs do=0.1 comparison,
  where 0.1 won for L/16 and R50+ViT-B/16 on ImageNet and CIFAR-100 and lost for
  B/16 and B/32). We take those values; R50+ViT-B/32 and R50+ViT-L/16, which
  have no official config, follow the other R50 hybrids (0.1). Attention
  dropout stays 0 everywhere, as there. BiT ResNets have no dropout layers.
"""
from typing import NamedTuple

from vit_jax import configs
from vit_jax import vtab
from vit_jax.configs import common
from vit_jax.models import variants


class Table4Row(NamedTuple):
  """One fine-tuning dataset: Table 4's steps and learning rates, and our choices
  where the paper is silent (module docstring)."""
  tfds_name: str
  num_classes: int
  total_steps: int
  lr_grid: tuple[float, ...]  # Table 4's sweep.
  base_lr: float  # The default, one of lr_grid.
  warmup_steps: int
  train_split: str  # Final protocol: train here, evaluate on test_split.
  test_split: str
  dev_train_split: str  # Development protocol (',dev'): train here, evaluate on dev_eval_split.
  dev_eval_split: str
  train_crop: str  # pp.train_crop: 'inception' or 'resize'.
  flip: bool  # pp.flip: random horizontal flips in training.


_LR_GRID = (0.001, 0.003, 0.01, 0.03)  # Table 4, every dataset but ImageNet.

# Table 4: dataset key -> Table4Row.
TABLE4 = {
    'imagenet2012': Table4Row(tfds_name='imagenet2012', num_classes=1000, total_steps=20_000,
                              lr_grid=(0.003, 0.01, 0.03, 0.06), base_lr=0.03, warmup_steps=500,
                              train_split='train', test_split='validation',
                              dev_train_split='train[:99%]', dev_eval_split='train[99%:]',
                              train_crop='inception', flip=True),
    'cifar100': Table4Row(tfds_name='cifar100', num_classes=100, total_steps=10_000,
                          lr_grid=_LR_GRID, base_lr=0.01, warmup_steps=500, train_split='train',
                          test_split='test', dev_train_split='train[:98%]',
                          dev_eval_split='train[98%:]', train_crop='inception', flip=True),
    'cifar10': Table4Row(tfds_name='cifar10', num_classes=10, total_steps=10_000, lr_grid=_LR_GRID,
                         base_lr=0.003, warmup_steps=500, train_split='train', test_split='test',
                         dev_train_split='train[:98%]', dev_eval_split='train[98%:]',
                         train_crop='inception', flip=True),
    'oxford_iiit_pet': Table4Row(tfds_name='oxford_iiit_pet', num_classes=37, total_steps=500,
                                 lr_grid=_LR_GRID, base_lr=0.003, warmup_steps=100,
                                 train_split='train', test_split='test',
                                 dev_train_split='train[:90%]', dev_eval_split='train[90%:]',
                                 train_crop='inception', flip=True),
    'oxford_flowers102': Table4Row(tfds_name='oxford_flowers102', num_classes=102, total_steps=500,
                                   lr_grid=_LR_GRID, base_lr=0.003, warmup_steps=100,
                                   train_split='train', test_split='test',
                                   dev_train_split='train[:90%]', dev_eval_split='train[90%:]',
                                   train_crop='inception', flip=True),
}

# VTAB-1k, 19 tasks (vit_jax/vtab.py): 2500 steps, LR 0.01.
VTAB = vtab.VTAB

# Models with a published ImageNet-21k checkpoint at pretrained_path(model): the
# paper's five ViTs (Table 5), the published hybrid, and the BiT-M ResNets that are
# also Table 6 baselines. Other names work too, with --config.pretrained_path.
MODELS = ('ViT-B_16', 'ViT-B_32', 'ViT-L_16', 'ViT-L_32', 'ViT-H_14', 'R50+ViT-B_16', 'R50x1',
          'R101x1', 'R152x2')

# Fine-tuning dropout of the official repository's model configs (module docstring);
# models with a Transformer not listed here get 0.0.
FINETUNE_DROPOUT = {
    'ViT-L_16': 0.1,
    'ViT-H_14': 0.1,
    'R50+ViT-B_16': 0.1,
    'R50+ViT-L_32': 0.1,
    'R50+ViT-B_32': 0.1,
    'R50+ViT-L_16': 0.1
}

RESOLUTION = 384  # Table 4.


def rows():
  """Every dataset key this file accepts (VTAB tasks as 'vtab/<task>')."""
  return list(TABLE4) + [f'vtab/{t}' for t in VTAB]


def pretrained_path(model):
  """The published ImageNet-21k checkpoint of a model name."""
  if 'ViT-' in model:
    return f'gs://vit_models/imagenet21k/{model}.npz'
  if model.startswith('BiT-'):  # Already a file stem: 'BiT-M-R50x3'.
    return f'gs://bit_models/{model}.npz'
  return f'gs://bit_models/BiT-M-{model}.npz'  # BiT-M: the ImageNet-21k BiT ResNets.


def unpublished_note(model, path):
  """A note for a pretrained_path that could not be read: where it is the default path of a
  model outside MODELS (ViT-Ti_16: that address was never published), the fix is another
  file, not the download the error names."""
  if model in MODELS or path != pretrained_path(model):
    return ''
  return (f' ({model} is not among the published ImageNet-21k checkpoints this default path '
          f'is known for: {", ".join(MODELS)}; set --config.pretrained_path to a {model} .npz)')


def image_size_for(model):
  """Fine-tuning resolution of a row (module docstring): 384, or for a model whose
  pixels per token do not divide 384 the largest multiple of them below 384 (/14: 378).
  Names outside the variant table get 384."""
  if model not in variants.VARIANTS:
    return RESOLUTION
  patch = variants.pixels_per_token(variants.get_variant(model))
  return RESOLUTION // patch * patch


def _vtab_row(task):
  """The Table4Row of a VTAB-1k task (vtab.Task): 2500 steps at LR 0.01, whole images."""
  return Table4Row(tfds_name=task.tfds_name, num_classes=task.num_classes,
                   total_steps=vtab.VTAB_STEPS, lr_grid=(vtab.VTAB_LR,), base_lr=vtab.VTAB_LR,
                   warmup_steps=vtab.VTAB_WARMUP, train_split=f'{task.train800}+{task.val200}',
                   test_split=task.test, dev_train_split=task.train800, dev_eval_split=task.val200,
                   train_crop='resize', flip=task.flip)


def get_config(arg=None):
  """Config of one Table 4 row; arg is '<model>,<dataset>[,dev]'."""
  parts = [p.strip() for p in (arg or '').split(',')]
  usage = ('--config=finetune:<model>,<dataset>[,dev] with a dataset among: ' + ' '.join(rows()))
  if len(parts) not in (2, 3) or not parts[0] or (len(parts) == 3 and parts[2] != 'dev'):
    raise configs.bad_argument('finetune', arg, usage)
  model, dataset = parts[:2]
  dev = len(parts) == 3

  c = common.get_config()
  if dataset in TABLE4:
    row = TABLE4[dataset]
  elif dataset.startswith('vtab/') and dataset[len('vtab/'):] in VTAB:
    c.vtab_task = dataset[len('vtab/'):]
    row = _vtab_row(VTAB[c.vtab_task])
  else:
    raise ValueError(f'{dataset!r} is not a row of Table 4: use {usage}')

  c.model_name = model
  if 'ViT-' in model:  # Models with a Transformer.
    c.model.dropout_rate = FINETUNE_DROPOUT.get(model, 0.0)
    c.model.attention_dropout_rate = 0.0
  c.num_classes = row.num_classes
  c.head_bias_init = 0.0
  c.loss = 'softmax_xent'
  c.pretrained_path = pretrained_path(model)
  c.pretrained_keep_prelogits = False

  c.dataset = row.tfds_name
  c.train_split = row.dev_train_split if dev else row.train_split
  c.eval_split = row.dev_eval_split if dev else row.test_split
  c.image_size = image_size_for(model)
  c.pp.train_crop = row.train_crop
  c.pp.flip = row.flip
  c.pp.eval_crop = 'resize'

  c.batch_size = 512
  c.optimizer = 'sgd'
  c.momentum = 0.9
  c.lr_grid = tuple(float(lr) for lr in row.lr_grid)
  c.base_lr = float(row.base_lr)
  c.lr_decay = 'cosine'
  c.end_lr = 0.0
  c.warmup_steps = row.warmup_steps
  c.total_steps = row.total_steps
  c.weight_decay = 0.0
  c.grad_clip_norm = 1.0
  return c
