"""Polyak averaging of the parameters (Appendix B.1.1: factor 0.9999 for Table 2's ImageNet).

An exponential moving average of the iterates, kept in the train state beside the
parameters (same shardings, float32) and checkpointed with them:

    sum_t = decay * sum_{t-1} + (1 - decay) * params_t      sum_0 = 0
    weight_t = decay * weight_{t-1} + (1 - decay)            weight_0 = 0
    averaged_t = sum_t / weight_t

The paper does not say how the average starts. Started at zero and divided by its total
weight (as Adam debiases its moments), the average holds only trained iterates; started
at the initial parameters, as tf.train.ExponentialMovingAverage does, a 20k-step
ImageNet fine-tune would keep 0.9999**20000 = 13.5% of the pre-trained start and its
zero head. The weight is accumulated with the same float32 arithmetic as the sum, so
their ratio is exact at every step.
"""
import jax
import jax.numpy as jnp


def enabled(config):
  return config.get('polyak_decay', 0.0) > 0


def validate(config):
  decay = config.get('polyak_decay', 0.0)
  if not 0 <= decay < 1:
    raise ValueError(f'polyak_decay {decay} is not in [0, 1): set --config.polyak_decay to '
                     'e.g. 0.9999 (the paper\'s Table 2), or 0 for no averaging')


def init(params):
  """The empty average of `params` (zeros like them, weight 0)."""
  return {'sum': jax.tree.map(jnp.zeros_like, params), 'weight': jnp.zeros((), jnp.float32)}


def update(average, params, decay):
  """The average after one more iterate `params`."""
  mix = lambda old, new: decay * old + (1 - decay) * new
  return {
      'sum': jax.tree.map(mix, average['sum'], params),
      'weight': mix(average['weight'], jnp.float32(1))
  }


def averaged(average, params, xp=jnp):
  """The averaged parameters; `params` themselves while the average is empty (step 0).
  xp=np: on the host, in NumPy's IEEE division, which the loop's jitted export matched where
  XLA:CPU's own, called outside it, came out an ulp off (checkpoint.load_run's `step`)."""
  weight = average['weight']
  return jax.tree.map(lambda s, p: xp.where(weight > 0, s / xp.maximum(weight, 1e-30), p),
                      average['sum'], params)
