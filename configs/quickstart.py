r"""The offline default: a small ViT on Fashion-MNIST, minutes on 2 CPU cores.

  vit-train --config=quickstart --workdir=workdirs/quickstart

Fashion-MNIST from the local IDX files (see input_pipeline: 'fashion_mnist_local'),
28x28 gray, 10 classes; the goal is >= 85% test accuracy. The model is ViT-Ti/16
made smaller with the variant overrides: 7x7 patches (a 4x4 grid of 16), fewer and
narrower layers. No horizontal flip: label-preserving here, but every shoe in the
data faces the same way and a short run underfits rather than overfits.
The numbers are meant to be tuned: every one is a --config.x override.
"""
from vit_jax.configs import common

# The knobs most worth tuning, in one place. 7x7 patches (17 tokens) ended 2000 steps at the
# top-1 of 4x4 ones (50 tokens) in a third of the time (benchmarks/README.md).
MODEL = dict(patch_size=7, hidden_size=64, mlp_dim=128, num_heads=4, num_layers=4, dropout_rate=0.0,
             attention_dropout_rate=0.0)
BATCH_SIZE = 128
TOTAL_STEPS = 2000  # ~4.3 epochs of the 60,000 training images.
WARMUP_STEPS = 200
BASE_LR = 1e-3


def get_config(arg=None):
  """The quickstart config (no argument)."""
  if arg:
    raise ValueError(f'the quickstart config takes no argument (got {arg!r}): use '
                     '--config=quickstart and --config.x=... overrides')
  c = common.get_config()
  c.model_name = 'ViT-Ti_16'
  for name, value in MODEL.items():
    c.model[name] = value

  c.dataset = 'fashion_mnist_local'
  c.train_split = 'train'
  c.eval_split = 'test'
  c.image_size = 28
  c.pp.train_crop = 'resize'
  c.pp.flip = False
  c.pp.eval_crop = 'resize'
  c.shuffle_buffer = 60_000  # The whole training set.

  c.batch_size = BATCH_SIZE
  c.eval_batch_size = 1000
  c.optimizer = 'adam'
  c.base_lr = BASE_LR
  c.lr_decay = 'cosine'
  c.end_lr = 0.0
  c.warmup_steps = WARMUP_STEPS
  c.total_steps = TOTAL_STEPS
  c.weight_decay = 0.05  # Mild: multiplied by the learning rate (AdamW), kernels only.
  c.grad_clip_norm = 1.0
  c.loss = 'softmax_xent'

  # Two CPU devices, data parallel: the small model's attention dots run on one thread
  # each, and a second device's program fills the other core (benchmarks/README.md).
  c.cpu_devices = 2

  c.log_every_steps = 100
  c.eval_every_steps = 500
  c.checkpoint_every_steps = 1000
  return c
