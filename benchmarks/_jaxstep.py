"""The real vit_jax training step (make_train_step + make_optimizer('sgd')), compiled once.

Used by train_step.py, vs_pytorch.py and loop.py so that all three time the same thing.
"""
import time

import _common  # noqa: F401  (puts the repo on sys.path)
import jax
import numpy as np

from vit_jax.configs import common as common_config
from vit_jax import flops as vflops
from vit_jax import optim
from vit_jax import sharding
from vit_jax import train


def make_config(model_name, batch, *, dtype='float32', remat=False, accum_steps=1,
                mesh=1, image_size=224, overrides=None):
  """A common.py config for SGD momentum 0.9 + global-norm clip 1 (Table 4's step)."""
  c = common_config.get_config()
  c.model_name = model_name
  for k, v in (overrides or {}).items():
    c.model[k] = v
  c.dtype = dtype
  c.remat = remat
  c.accum_steps = accum_steps
  c.mesh_data = mesh
  c.image_size = image_size
  c.batch_size = batch
  c.optimizer = 'sgd'
  c.momentum = 0.9
  c.grad_clip_norm = 1.0
  c.base_lr = 0.01
  c.lr_decay = 'cosine'
  c.warmup_steps = 10
  c.total_steps = 10_000
  c.weight_decay = 0.0
  return c


class BareStep:
  """Compiled train step on a random device-resident batch (no input pipeline)."""

  def __init__(self, config, num_classes=1000):
    self.config = config
    self.num_classes = num_classes
    total = optim.total_steps(config)
    schedule = optim.learning_rate_schedule(config, total)
    tx = optim.make_optimizer(config, total)
    model = train.build_model(config, num_classes)
    mesh = sharding.make_mesh(config)
    self.mesh = mesh
    batch_sh = sharding.data_sharding(mesh)
    repl = sharding.replicated(mesh)
    size = config.image_size
    # The loop's own state set-up (initialised: no checkpoint manager).
    self.state, state_sh = train.create_train_state(config, model, tx, mesh, num_classes)
    self.num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.state['params']))
    rng = np.random.default_rng(0)
    b = config.batch_size
    batch = {'image': rng.uniform(-1, 1, (b, size, size, 3)).astype(np.float32),
             'label': rng.integers(0, num_classes, (b,)).astype(np.int32)}
    self.batch = jax.device_put(batch, batch_sh)
    self.rng = jax.device_put(jax.random.PRNGKey(0), repl)
    jitted = jax.jit(train.make_train_step(model, tx, schedule, config, mesh),
                     in_shardings=(state_sh, batch_sh, repl),
                     out_shardings=(state_sh, repl), donate_argnums=(0,))
    t = time.perf_counter()
    self.compiled = jitted.lower(self.state, self.batch, self.rng).compile()
    self.compile_s = time.perf_counter() - t
    self.flops_analytic = vflops.train_step_flops(
        config.model_name, b, size, num_classes, **config.model.to_dict())
    # The compiled program is per device under SPMD: scale to the whole step.
    xla = _common.cost_flops(self.compiled)
    self.flops_xla = None if xla is None else xla * len(mesh.devices.flat)
    self.memory_gib = _common.compiled_memory_gib(self.compiled)

  def run(self, steps):
    """Runs `steps` steps, blocking after each; returns the wall time of each (s)."""
    times = []
    for _ in range(steps):
      t = time.perf_counter()
      self.state, metrics = self.compiled(self.state, self.batch, self.rng)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - t)
      if not np.isfinite(float(metrics['loss'])):
        raise FloatingPointError(f'loss is {metrics["loss"]}')
    return times
