r"""Masked patch prediction pre-training (paper Sec. 4.6, Appendix B.1.2).

  --config=masked_patches:<model>,<dataset>   or   masked_patches:quickstart
  e.g. masked_patches:ViT-B_16,jft300m
       masked_patches:ViT-B_16,imagenet21k
       masked_patches:quickstart            (Fashion-MNIST miniature, offline)

The paper's run (B.1.2): ViT-B/16 on JFT, "1M steps (ca. 14 epochs) with batch size
4096", "Adam, with a base learning rate of 2*10^-4, warmup of 10k steps and cosine
learning rate decay"; 50% of the patches corrupted (80% [mask], 10% random other
patch, 10% kept), target the 3-bit mean colour (512 classes). See
vit_jax/masked_patches.py for the objective and every choice made where the paper is
silent. The result (final.npz) is an ordinary checkpoint: fine-tune it with
  --config=finetune:ViT-B_16,imagenet2012 --config.pretrained_path=<workdir>/final.npz
(load_pretrained drops mask_embedding and masked_patch_head as it drops pre-logits).

Choices where the paper is silent:
- Adam (0.9, 0.999), weight decay 0.1 and no gradient clipping: Table 3's JFT rows
  (B.1.2 names only the optimiser, learning rate, warm-up and decay). No dropout.
- No pre-logits layer: the objective never reaches it (the pooled class token is not
  predicted from); the fine-tuning configs build models without one.
- ImageNet-21k and ImageNet: 100k steps, otherwise the JFT recipe. B.1.2: "we observed
  diminishing returns on downstream performance after 100k pretraining steps, and see
  similar gains when pretraining on ImageNet". 1M steps there would be 330 (21k) or
  3,200 (ImageNet) epochs; set --config.total_steps=1000000 for the JFT length.
- Any plain ViT name is accepted (the paper ran only ViT-B/16); hybrids and BiT are
  refused, as the targets are pixel patches.
"""
from vit_jax import configs
from vit_jax.configs import common
from vit_jax.configs import pretrain
from vit_jax.configs import quickstart
from vit_jax import masked_patches as objective
from vit_jax.models import variants

# dataset -> total steps (B.1.2: 1M on JFT; 100k elsewhere, see the module doc).
STEPS = {'jft300m': 1_000_000, 'imagenet21k': 100_000, 'imagenet2012': 100_000}
BASE_LR = 2e-4
WARMUP_STEPS = 10_000
BATCH_SIZE = 4096

# The Fashion-MNIST miniature: the quickstart model, pre-trained without labels, on 4x4
# patches (the README's figures were measured so): of a grid of 49, 25 are corrupted and
# 24 left to predict from; the quickstart's 16 patches of 7x7 would leave 8.
QUICKSTART_PATCH_SIZE = 4
QUICKSTART_STEPS = 1500
QUICKSTART_WARMUP = 150
QUICKSTART_LR = 1e-3


def _usage():
  rows = ' '.join(f'ViT-B_16,{d}' for d in STEPS)
  return (f'--config=masked_patches:<model>,<dataset> (e.g. {rows}; any plain ViT-<size>_'
          '<patch>) or --config=masked_patches:quickstart')


def add_fields(c):
  """Adds `objective` and the `masked_patches` sub-config if common.py lacks them."""
  if 'objective' not in c:
    c.objective = 'classification'
  if 'masked_patches' not in c:
    c.masked_patches = objective.default_config()
  return c


def get_config(arg=None):
  """Config of one row; arg is '<model>,<dataset>' or 'quickstart'."""
  arg = (arg or '').strip()
  if arg == 'quickstart':
    c = add_fields(quickstart.get_config())
    c.objective = 'masked_patches'
    c.model.patch_size = QUICKSTART_PATCH_SIZE
    c.total_steps = QUICKSTART_STEPS
    c.warmup_steps = QUICKSTART_WARMUP
    c.base_lr = QUICKSTART_LR
    c.eval_every_steps = 500
    c.checkpoint_every_steps = 500
    return c
  parts = [p.strip() for p in arg.split(',')]
  if len(parts) != 2:
    raise configs.bad_argument('masked_patches', arg, _usage())
  model, dataset = parts
  if dataset not in STEPS:
    raise ValueError(f'dataset {dataset!r} has no masked-patch row: use one of '
                     f'{", ".join(STEPS)} ({_usage()})')
  if not variants.is_plain_vit(model):
    raise ValueError(f'model {model!r} is not a plain ViT: masked patch prediction needs '
                     f'ViT-<size>_<patch> ({_usage()})')
  data = pretrain.DATASETS[dataset]

  c = add_fields(common.get_config())
  c.objective = 'masked_patches'
  c.model_name = model
  c.model.dropout_rate = 0.0
  c.model.attention_dropout_rate = 0.0
  c.dataset = data['tfds']
  c.train_split = data['train']
  c.eval_split = data['eval']
  c.num_train_examples = data['examples']
  c.image_size = 224

  c.batch_size = BATCH_SIZE
  c.optimizer = 'adam'
  c.adam_b1 = 0.9
  c.adam_b2 = 0.999
  c.base_lr = BASE_LR
  c.lr_decay = 'cosine'
  c.end_lr = 0.0
  c.warmup_steps = WARMUP_STEPS
  c.total_steps = STEPS[dataset]
  c.num_epochs = -1.0
  c.weight_decay = 0.1
  c.grad_clip_norm = 0.0
  c.eval_every_steps = 10_000
  c.checkpoint_every_steps = 5_000

  # Few-shot linear evaluation of the (frozen) representation, ready but off, as in
  # pretrain.py: --config.fewshot_every_steps=10000 when imagenet2012 is in data_dir.
  c.fewshot_datasets = (('imagenet2012', 'train[:5%]', 'validation'),)
  c.fewshot_shots = (5,)
  return c
