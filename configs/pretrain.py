r"""Pre-training, every row of the paper's Table 3 (Appendix B.1).

  --config=pretrain:<model>,<dataset>[,<epochs>]
  e.g. pretrain:ViT-B_16,jft300m   pretrain:ViT-L_16,imagenet21k,30
       pretrain:ViT-H_14,imagenet2012

Table 3's "ViT-*" ImageNet row takes any plain ViT name, ViT-<Ti|S|B|L|H>_<8|14|16|32>;
IMAGENET_MODELS are Table 5's five models (it reports ImageNet pre-training for all but
ViT-H/14; the row takes that one all the same).

All rows: batch 4096, 10k warm-up steps, Adam (0.9, 0.999), resolution 224,
total_steps = ceil(epochs * num_train_examples / batch) (vit_jax.optim.total_steps).
Choices where the paper is silent or terse:
- Gradient clipping at global norm 1 only for the ImageNet rows: B.1 says "For
  ImageNet we found it beneficial to *additionally* apply gradient clipping".
- Weight decay is decoupled and multiplied by the learning rate (AdamW), on
  kernels only (see vit_jax/optim.py).
- JFT-300M and ImageNet-21k rows follow the published ImageNet-21k recipe
  (official repository's issues): sigmoid cross-entropy, head bias -10,
  pre-logits of the hidden size D, linear decay to end_lr 1e-5. ImageNet rows:
  softmax cross-entropy, cosine decay to 0, pre-logits of size D too (Sec. 3.1:
  "an MLP with one hidden layer at pre-training time").
- "7/14" and "30/90" epochs are the optional third argument; defaults: 7 for
  JFT-300M (as the other JFT rows and Table 6's first rows), 90 for ImageNet-21k
  (as the ViT-B rows). R152x2 also accepts 14 (its Table 6 row).
- Table 3's dropout goes to model.dropout_rate of models with a Transformer;
  attention dropout stays 0 as in the published models. BiT ResNets get neither
  dropout nor pre-logits (they have no such layers).
- R200x3 (Table 6) has no Table 3 row, so it has no row here either.
"""
from typing import NamedTuple

from vit_jax import configs
from vit_jax.configs import common
from vit_jax.models import variants


class Table3Row(NamedTuple):
  """One row of Table 3."""
  models: tuple[str, ...]  # ('ViT-*',): any plain ViT.
  dataset: str  # A key of DATASETS.
  epochs: tuple[float, ...]  # Allowed; the first is the default.
  base_lr: float
  lr_decay: str
  weight_decay: float
  dropout: float  # model.dropout_rate of models with a Transformer.


# Table 3, one Table3Row (models, dataset, epochs, base_lr, lr_decay, weight_decay, dropout)
# per line.
TABLE3 = tuple(
    Table3Row(*row) for row in (
        (('ViT-B_16', 'ViT-B_32'), 'jft300m', (7,), 8e-4, 'linear', 0.1, 0.0),
        (('ViT-L_32',), 'jft300m', (7,), 6e-4, 'linear', 0.1, 0.0),
        (('ViT-L_16',), 'jft300m', (7, 14), 4e-4, 'linear', 0.1, 0.0),
        (('ViT-H_14',), 'jft300m', (14,), 3e-4, 'linear', 0.1, 0.0),
        (('R50x1', 'R50x2'), 'jft300m', (7,), 1e-3, 'linear', 0.1, 0.0),
        (('R101x1',), 'jft300m', (7,), 8e-4, 'linear', 0.1, 0.0),
        (('R152x1',), 'jft300m', (7,), 6e-4, 'linear', 0.1, 0.0),
        (('R152x2',), 'jft300m', (7, 14), 6e-4, 'linear', 0.1, 0.0),  # 14: Table 6.
        (('R50+ViT-B_16', 'R50+ViT-B_32'), 'jft300m', (7,), 8e-4, 'linear', 0.1, 0.0),
        (('R50+ViT-L_32',), 'jft300m', (7,), 2e-4, 'linear', 0.1, 0.0),
        (('R50+ViT-L_16',), 'jft300m', (7, 14), 4e-4, 'linear', 0.1, 0.0),
        (('ViT-B_16', 'ViT-B_32'), 'imagenet21k', (90,), 1e-3, 'linear', 0.03, 0.1),
        (('ViT-L_16', 'ViT-L_32'), 'imagenet21k', (90, 30), 1e-3, 'linear', 0.03, 0.1),
        (('ViT-*',), 'imagenet2012', (300,), 3e-3, 'cosine', 0.3, 0.1),
    ))

# ImageNet-21k images per epoch: 12.4M. The paper says "14M images" (14,197,122 in
# the fall 2011 release, 21,841 synsets), but the maintainers state that the set they
# pre-trained on has approximately 12.4M images, because duplicate images were merged
# (google-research/vision_transformer issue #28, 2020-11-24; repeated in #237), so the
# paper's epochs are epochs of 12.4M. The split layout is the public big_vision
# 'imagenet21k' builder's (a single 'full' split; the first 51,200 images are held
# out, 25,600 of them as minival), which is not subtracted from the count. A user
# whose builder has another size sets --config.num_train_examples.
I21K_IMAGES = 12_400_000

# Table 5's models (the "ViT-*" row names no list; Table 5 has no ImageNet ViT-H/14).
IMAGENET_MODELS = ('ViT-B_16', 'ViT-B_32', 'ViT-L_16', 'ViT-L_32', 'ViT-H_14')

# Per dataset: TFDS name, splits, size (Sec. 4.1 / B.1), loss, head bias, end_lr, clip.
DATASETS = {
    # 'jft' is private: the builder and its split names are the user's.
    'jft300m': dict(tfds='jft', train='train', eval='validation', examples=303_000_000,
                    loss='sigmoid_xent', head_bias_init=-10.0, end_lr=1e-5, clip=0.0),
    # 'imagenet21k' is not in public TFDS: a user-provided builder.
    'imagenet21k': dict(tfds='imagenet21k', train='full[51200:]', eval='full[:25600]',
                        examples=I21K_IMAGES, loss='sigmoid_xent', head_bias_init=-10.0,
                        end_lr=1e-5, clip=0.0),
    'imagenet2012': dict(tfds='imagenet2012', train='train', eval='validation', examples=1_281_167,
                         loss='softmax_xent', head_bias_init=0.0, end_lr=0.0, clip=1.0),
}


def rows():
  """Every (model, dataset) of Table 3, the "ViT-*" row as IMAGENET_MODELS."""
  return [(m, row.dataset) for row in TABLE3
          for m in (IMAGENET_MODELS if row.models == ('ViT-*',) else row.models)]


def _usage_rows():
  names = [f'{m},{d}' for m, d in rows() if d != 'imagenet2012']
  sizes, patches = '|'.join(variants.VIT_SIZES), '|'.join(map(str, variants.VIT_PATCHES))
  return names + [f'ViT-<{sizes}>_<{patches}>,imagenet2012']


def _find_row(model, dataset):
  for row in TABLE3:
    if row.dataset != dataset:
      continue
    for pattern in row.models:
      if variants.is_plain_vit(model) if pattern == 'ViT-*' else model == pattern:
        return row
  return None


def get_config(arg=None):
  """Config of one Table 3 row; arg is '<model>,<dataset>[,<epochs>]'."""
  parts = [p.strip() for p in (arg or '').split(',')]
  usage = ('--config=pretrain:<model>,<dataset>[,<epochs>] with one of the rows: '
           + ' '.join(_usage_rows()))
  if len(parts) not in (2, 3):
    raise configs.bad_argument('pretrain', arg, usage)
  model, dataset = parts[:2]
  row = _find_row(model, dataset)
  if row is None:
    raise ValueError(f'{model},{dataset} is not a row of Table 3: use {usage}')
  epochs = row.epochs[0]
  if len(parts) == 3:
    try:
      epochs = float(parts[2])
    except ValueError:
      epochs = None
    if epochs not in row.epochs:
      allowed = ' or '.join(str(e) for e in row.epochs)
      raise ValueError(f'epochs {parts[2]!r} is not in Table 3 for {model},{dataset}: '
                       f'use {allowed} (or override --config.num_epochs)')
  data = DATASETS[dataset]

  c = common.get_config()
  c.model_name = model
  fields = variants.VARIANTS[model]  # _find_row accepts variant names only.
  if fields['family'] == 'vit':  # Models with a Transformer: Table 3 dropout, pre-logits of D.
    c.model.dropout_rate = float(row.dropout)
    c.model.attention_dropout_rate = 0.0
    c.model.representation_size = fields['hidden_size']
  c.head_bias_init = data['head_bias_init']
  c.loss = data['loss']

  c.dataset = data['tfds']
  c.train_split = data['train']
  c.eval_split = data['eval']
  c.num_train_examples = data['examples']
  c.image_size = 224

  c.batch_size = 4096
  c.optimizer = 'adam'
  c.adam_b1 = 0.9
  c.adam_b2 = 0.999
  c.base_lr = float(row.base_lr)
  c.lr_decay = row.lr_decay
  c.end_lr = data['end_lr']
  c.warmup_steps = 10_000
  c.num_epochs = float(epochs)
  c.total_steps = -1  # Derived: ceil(num_epochs * num_train_examples / batch_size).
  c.weight_decay = float(row.weight_decay)
  c.grad_clip_norm = data['clip']

  # The paper's "5-shot ImageNet linear" (Fig. 4), ready but off: turn it on with
  # --config.fewshot_every_steps=10000 when imagenet2012 is in data_dir. The pool is a
  # slice of the training set (about 64 images per class) so start-up stays short.
  c.fewshot_datasets = (('imagenet2012', 'train[:5%]', 'validation'),)
  c.fewshot_shots = (5,)
  return c
