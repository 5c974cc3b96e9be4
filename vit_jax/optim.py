"""Optimisers and learning-rate schedules of the ViT paper (Appendix B.1).

Pre-training (Table 3): Adam (b1 0.9, b2 0.999), "high" weight decay, linear
warm-up then linear or cosine decay. Fine-tuning (Table 4): SGD with momentum
0.9, cosine decay, no weight decay, gradient clipping at global norm 1.

The update of one step, for every parameter p with gradient g:

  g = clip_by_global_norm(g, grad_clip_norm)       if grad_clip_norm > 0
  u = adam(g) | momentum(g)                        per-parameter moments
  u = u + weight_decay * p                         only where the path ends in 'kernel'
  p = p - lr(step) * u

so the weight decay is decoupled from the gradient and multiplied by the
learning rate, as AdamW (Loshchilov & Hutter); biases, LayerNorm/GroupNorm
scales, position embeddings and the class token are not decayed.
"""
import fractions
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax

OPTIMIZERS = ('adam', 'sgd')
LR_DECAYS = ('linear', 'cosine')
LOSSES = ('softmax_xent', 'sigmoid_xent')

# The run's length is total_steps or num_epochs, the one > 0 (<= 0: unset; validate refuses both).
_NO_LENGTH = ('total_steps {} and num_epochs {} give the run no length (each <= 0 is unset): '
              'set --config.total_steps or --config.num_epochs to a positive value')


def total_steps(config, num_train_examples: Optional[int] = None) -> int:
  """Training steps: config.total_steps if > 0, else ceil(num_epochs * N / batch_size).

  N is config.num_train_examples when > 0, else `num_train_examples` (the
  dataset's count). Rounding is up, so at least num_epochs epochs are seen; the
  product is computed exactly (the epochs as written in decimal), so 0.1 epochs
  of 40,960 examples at batch 4,096 is 1 step, not 2.
  """
  if config.total_steps > 0:
    return int(config.total_steps)
  if config.num_epochs <= 0:
    raise ValueError(_NO_LENGTH.format(config.total_steps, config.num_epochs))
  n = config.num_train_examples
  if n is None or n <= 0:
    n = num_train_examples
  if n is None or n <= 0:
    raise ValueError(f'num_train_examples {n} is unknown, so num_epochs cannot '
                     'become steps: set --config.num_train_examples or '
                     '--config.total_steps')
  epochs = fractions.Fraction(str(float(config.num_epochs)))
  return max(1, math.ceil(epochs * int(n) / int(config.batch_size)))


def known_total_steps(config, num_train_examples: Optional[int] = None) -> Optional[int]:
  """total_steps(config, num_train_examples) where it is known (given, or from num_epochs
  and a known example count), else None."""
  known = config.total_steps > 0 or config.num_train_examples > 0 or (num_train_examples is not None
                                                                      and num_train_examples > 0)
  return total_steps(config, num_train_examples) if known else None


def learning_rate_schedule(config, total_steps: int) -> Callable:  # pylint: disable=redefined-outer-name
  """Returns step -> learning rate (a float32 scalar; works under jit).

  Linear warm-up from 0 at step 0 to base_lr at step warmup_steps, then over
  the remaining steps either 'linear' decay to end_lr at total_steps, or
  'cosine' decay to 0 at total_steps. Steps past total_steps keep the last value.
  """
  _check_choice('lr_decay', config.lr_decay, LR_DECAYS)
  base_lr = float(config.base_lr)
  end_lr = float(config.end_lr)
  warmup = int(config.warmup_steps)
  decay_steps = max(int(total_steps) - warmup, 1)
  kind = config.lr_decay

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    progress = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
    if kind == 'linear':
      lr = end_lr + (base_lr - end_lr) * (1.0 - progress)
    else:
      lr = 0.5 * base_lr * (1.0 + jnp.cos(jnp.pi * progress))
    if warmup > 0:
      lr = jnp.where(step < warmup, base_lr * step / warmup, lr)
    return lr

  return schedule


def kernel_mask(params):
  """True for the leaves whose path ends in 'kernel' (the weight-decayed ones)."""

  def is_kernel(path, _):
    last = path[-1] if path else None
    name = getattr(last, 'key', getattr(last, 'name', None))
    return name == 'kernel'

  return jax.tree_util.tree_map_with_path(is_kernel, params)


def make_optimizer(config, total_steps: int) -> optax.GradientTransformation:  # pylint: disable=redefined-outer-name
  """The optax chain of the module docstring for config.optimizer.

  The state keeps moments (Adam mu/nu, SGD trace) as trees of the same
  structure and shapes as the parameters, so they take the parameters'
  sharding; the other state entries hold no per-parameter arrays.
  """
  _check_choice('optimizer', config.optimizer, OPTIMIZERS)
  if config.grad_clip_norm > 0:
    clip = optax.clip_by_global_norm(float(config.grad_clip_norm))
  else:
    clip = optax.identity()
  if config.optimizer == 'adam':
    direction = optax.scale_by_adam(b1=float(config.adam_b1), b2=float(config.adam_b2))
  else:
    direction = optax.trace(decay=float(config.momentum))
  if config.weight_decay > 0:
    decay = optax.add_decayed_weights(float(config.weight_decay), mask=kernel_mask)
  else:
    decay = optax.identity()
  return optax.chain(
      clip,
      direction,
      decay,
      # Multiplies by -lr(count); count starts at 0, so the first update uses lr(0).
      optax.scale_by_learning_rate(learning_rate_schedule(config, total_steps)),
  )


def _check_choice(field, value, choices):
  if value not in choices:
    options = ' or '.join(repr(c) for c in choices)
    raise ValueError(f'{field} {value!r} is unknown: set --config.{field} to {options}')


_FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)


def validate(config, num_train_examples: Optional[int] = None) -> None:
  """Start-up checks of the optimisation fields; raises a one-line ValueError.

  The warm-up is checked against total_steps when those are known: given
  directly, or from num_epochs and config.num_train_examples (or the
  `num_train_examples` argument, the dataset's count).
  """
  _check_choice('optimizer', config.optimizer, OPTIMIZERS)
  _check_choice('lr_decay', config.lr_decay, LR_DECAYS)
  _check_choice('loss', config.loss, LOSSES)

  def fail(msg):
    raise ValueError(msg)

  if not config.base_lr > 0:
    fail(f'base_lr {config.base_lr} must be > 0: set --config.base_lr')
  if config.base_lr > _FLOAT32_MAX:  # it had overflowed to inf, with a NumPy warning
    fail(f'base_lr {config.base_lr:g} is beyond float32, in which the schedule computes '
         f'(largest {_FLOAT32_MAX:.3g}): set --config.base_lr to a learning rate, e.g. 0.001')
  if config.end_lr < 0 or config.end_lr > config.base_lr:
    fail(f'end_lr {config.end_lr} must be in [0, base_lr {config.base_lr}]: '
         'set --config.end_lr')
  if config.lr_decay == 'cosine' and config.end_lr != 0:
    fail(f'end_lr {config.end_lr} is only used by linear decay (cosine decays '
         'to 0): set --config.end_lr=0 or --config.lr_decay=linear')
  if any(not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0
         for lr in config.lr_grid):
    fail(f'lr_grid {tuple(config.lr_grid)} must hold learning rates > 0: set '
         '--config.lr_grid, e.g. to 0.003,0.01')
  if config.warmup_steps < 0:
    fail(f'warmup_steps {config.warmup_steps} must be >= 0: set --config.warmup_steps')
  if config.total_steps <= 0 and config.num_epochs <= 0:
    fail(_NO_LENGTH.format(config.total_steps, config.num_epochs))
  if config.total_steps > 0 and config.num_epochs > 0:  # one would be dropped without a word
    fail(f'total_steps {config.total_steps} and num_epochs {config.num_epochs} both give the '
         'run its length: set --config.total_steps=-1 to train for num_epochs, or '
         '--config.num_epochs=-1 to train for total_steps')
  if config.batch_size <= 0:
    fail(f'batch_size {config.batch_size} must be > 0: set --config.batch_size')
  if config.accum_steps < 0 or config.batch_size % max(config.accum_steps, 1):
    fail(f'accum_steps {config.accum_steps} must be >= 1 and divide batch_size '
         f'{config.batch_size} (or 0: the fewest that fit): set --config.accum_steps')
  if config.weight_decay < 0:
    fail(f'weight_decay {config.weight_decay} must be >= 0: set --config.weight_decay')
  if config.grad_clip_norm < 0:
    fail(f'grad_clip_norm {config.grad_clip_norm} must be >= 0 (0 turns '
         'clipping off): set --config.grad_clip_norm')
  for field in ('adam_b1', 'adam_b2', 'momentum'):
    if not 0 <= config[field] < 1:
      fail(f'{field} {config[field]} must be in [0, 1): set --config.{field}')

  steps = known_total_steps(config, num_train_examples)
  if steps is not None:
    if config.warmup_steps >= steps:
      fail(f'warmup_steps {config.warmup_steps} >= total_steps {steps}: lower '
           '--config.warmup_steps')
