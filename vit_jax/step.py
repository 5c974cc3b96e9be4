"""The train state and step: initialisation or restore, loss, gradients, update, metrics.

Kept apart from the loop (vit_jax/train.py) so that a step can be built, jitted and
measured without the input pipeline's TensorFlow (benchmarks/bare_step.py).
"""
import jax
import jax.numpy as jnp
import optax

from vit_jax import checkpoint
from vit_jax import masked_patches
from vit_jax import models
from vit_jax import polyak
from vit_jax import sharding
from vit_jax.models import accelerator
from vit_jax.models import remat as remat_lib

# XLA:GPU runs a program's kernels as command buffers (CUDA graphs) by default. In JAX's
# preallocated memory pool, where vit-train runs, the ViT train step ran faster without them
# and the hybrid's did not (benchmarks/README.md, thirtieth session: H200, b128; bf16
# ViT-B/16 1.07-1.09x, float32 1.03-1.07x; R50+ViT-B/16 0.97-0.98x, float32 1.00x). So a
# model without a ResNet stem compiles its step without them on an NVIDIA GPU.
NO_COMMAND_BUFFERS = {'xla_gpu_enable_command_buffer': ''}


def per_example_loss(logits, labels, kind, label_smoothing=0.0):
  """Softmax cross-entropy, or sigmoid cross-entropy summed over classes (multi-label).

  `labels`: int [N] classes, or multi-hot float [N, K] label sets (K <= the head's
  classes; units past K are negatives). Sigmoid takes the multi-hot targets as they
  are; softmax takes them normalised to sum 1 (cross-entropy to the uniform
  distribution over the set; an empty set gives 0). `label_smoothing` s: the targets
  become (1 - s) * y + s / C over the head's C classes.
  """
  if labels.ndim == logits.ndim:
    targets = jnp.pad(labels, ((0, 0), (0, logits.shape[-1] - labels.shape[-1])))
    if kind != 'sigmoid_xent':
      targets = targets / jnp.maximum(jnp.sum(targets, axis=-1, keepdims=True), 1.0)
  else:
    targets = jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32)  # float64 under x64
  if label_smoothing:
    targets = optax.smooth_labels(targets, label_smoothing)
  if kind == 'sigmoid_xent':
    return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, targets), axis=-1)
  return -jnp.sum(targets * jax.nn.log_softmax(logits), axis=-1)


def create_train_state(config, model, tx, mesh, num_classes, manager=None):
  """(state, its shardings) on `mesh`: the latest checkpoint of `manager` (restored onto
  any mesh), else initialised from config.seed or config.pretrained_path.

  state = {'step', 'params', 'opt_state', 'guard'} and, with config.polyak_decay, 'polyak'
  (vit_jax/polyak.py); 'guard' (the divergence record) is never checkpointed. Raises
  checkpoint.DifferentModelError for checkpoints of another model. The loop, the
  benchmarks and notebooks build their state here.
  """
  replicated = sharding.replicated(mesh)
  abstract_params = jax.eval_shape(lambda: _init(config, model, jax.random.PRNGKey(0)))
  param_sh = sharding.tree_shardings(abstract_params, mesh, config.fsdp)
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  opt_sh = sharding.tree_shardings(abstract_opt, mesh, config.fsdp)
  guard_sh = {
      k: replicated for k in ('first_bad', 'loss', 'grad_norm', 'update_norm', 'skipped',
                              'skipped_in_a_row', 'last_skipped')
  }
  saved_sh = {'step': replicated, 'params': param_sh, 'opt_state': opt_sh}
  abstract_saved = {
      'step': jax.ShapeDtypeStruct((), jnp.int32),
      'params': abstract_params,
      'opt_state': abstract_opt
  }
  if polyak.enabled(config):
    saved_sh['polyak'] = {'sum': param_sh, 'weight': replicated}
    abstract_saved['polyak'] = jax.eval_shape(polyak.init, abstract_params)
  state = None
  if manager is not None:
    state = checkpoint.restore_train_state(manager, _abstract(abstract_saved, saved_sh))
  if state is None:
    params = _initial_params(config, model, num_classes, param_sh)
    state = {
        'step': jax.device_put(jnp.int32(0), replicated),
        'params': params,
        'opt_state': jax.jit(tx.init, out_shardings=opt_sh)(params)
    }
    if polyak.enabled(config):
      state['polyak'] = jax.jit(polyak.init, out_shardings=saved_sh['polyak'])(params)
  state['guard'] = jax.device_put(
      {
          'first_bad': jnp.int32(0),
          'loss': jnp.float32(0),
          'grad_norm': jnp.float32(0),
          'update_norm': jnp.float32(0),
          'skipped': jnp.int32(0),
          'skipped_in_a_row': jnp.int32(0),
          'last_skipped': jnp.int32(0)
      }, guard_sh)
  return state, {**saved_sh, 'guard': guard_sh}


def _init(config, model, rng):
  """A freshly initialised parameter tree (the masked-patch objective adds its own)."""
  if masked_patches.is_masked(config):
    return masked_patches.init_params(model, rng, config.image_size, config.masked_patches)
  images = jnp.zeros((1, config.image_size, config.image_size, 3), jnp.float32)
  return model.init(rng, images, train=False)['params']


def _initial_params(config, model, num_classes, param_shardings):
  if config.pretrained_path:
    params = checkpoint.load_pretrained(config.pretrained_path, model, num_classes,
                                        config.image_size, head_bias_init=config.head_bias_init)
    return jax.device_put(params, param_shardings)
  init = jax.jit(lambda rng: _init(config, model, rng), out_shardings=param_shardings)
  return init(jax.random.PRNGKey(config.seed))


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def make_train_step(model, tx, schedule, config, mesh):
  """(state, batch, rng) -> (state, metrics); `accum_steps` micro-batches per step."""
  accum = config.accum_steps
  masked = masked_patches.is_masked(config)

  def grads(params, images, labels, rng, corrupt=None):

    def loss(p):
      if masked:  # self-supervised (vit_jax/masked_patches.py): labels unused
        return masked_patches.loss_fn(model, p, images, corrupt, config.masked_patches, rng=rng)[0]
      logits = model.apply({'params': p}, images, train=True, rngs={'dropout': rng})
      return jnp.mean(per_example_loss(logits, labels, config.loss, config.label_smoothing))

    return jax.value_and_grad(loss)(params)

  def step(state, batch, rng):
    params = state['params']
    rng = jax.random.fold_in(rng, state['step'])
    # Drawn for the whole batch, so micro-batches and devices do not change it.
    corrupt = (masked_patches.corruption_for_images(rng, batch['image'], model,
                                                    config.masked_patches) if masked else None)
    if accum == 1:
      loss, g = grads(params, batch['image'], batch['label'], rng, corrupt)
    else:
      # Micro-batch j takes rows j, j+accum, ...: every device keeps its own rows.
      def split(x):
        x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
        spec = jax.sharding.PartitionSpec(None, sharding.DATA)
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))

      def body(carry, xs):
        j, images, labels, corrupt_j = xs
        loss_j, g_j = grads(params, images, labels, jax.random.fold_in(rng, j), corrupt_j)
        return jax.tree.map(jnp.add, carry, (loss_j, g_j)), None

      zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
      micro_batches = (jnp.arange(accum), split(batch['image']), split(batch['label']),
                       jax.tree.map(split, corrupt))
      (loss, g), _ = jax.lax.scan(body, zeros, micro_batches)
      loss, g = jax.tree.map(lambda x: x / accum, (loss, g))
    updates, opt_state = tx.update(g, state['opt_state'], params)
    new_params = optax.apply_updates(params, updates)
    grad_norm = optax.tree.norm(g)
    # The update too: a finite gradient times a huge learning rate overflows to inf
    # parameters, which the next step's loss would show only after they were saved.
    update_norm = optax.tree.norm(updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
    if config.get('on_nonfinite', 'stop') == 'skip':  # the step counts, its update does not
      keep = lambda new, old: jnp.where(finite, new, old)
      new_params = jax.tree.map(keep, new_params, params)
      # The moments are kept, but the schedule's count goes on with the step: kept too, it
      # had applied lr(step - skips) from then on while the log showed lr(step).
      is_schedule = lambda x: isinstance(x, optax.ScaleByScheduleState)
      opt_state = jax.tree.map(lambda new, old: new if is_schedule(new) else keep(new, old),
                               opt_state, state['opt_state'], is_leaf=is_schedule)
    new_state = {'step': state['step'] + 1, 'params': new_params, 'opt_state': opt_state}
    if 'polyak' in state:
      new_state['polyak'] = polyak.update(state['polyak'], new_params, config.polyak_decay)
    metrics = {'loss': loss, 'grad_norm': grad_norm, 'lr': schedule(state['step'])}
    if 'guard' in state:  # the loop's divergence guard: the first non-finite step, on device
      guard = state['guard']
      first = (guard['first_bad'] == 0) & ~finite
      new_state['guard'] = metrics['guard'] = {
          'first_bad': jnp.where(first, state['step'] + 1, guard['first_bad']),
          'loss': jnp.where(first, loss, guard['loss']),
          'grad_norm': jnp.where(first, grad_norm, guard['grad_norm']),
          'update_norm': jnp.where(first, update_norm, guard['update_norm']),
          'skipped': guard['skipped'] + (~finite).astype(jnp.int32),
          'skipped_in_a_row': jnp.where(finite, 0, guard['skipped_in_a_row'] + 1),
          'last_skipped': jnp.where(finite, guard['last_skipped'], state['step'] + 1)
      }
    return new_state, metrics

  return step


def jit(model, tx, schedule, config, mesh, in_shardings):
  """The step jitted for `in_shardings` (state, batch, rng); the state is donated."""
  return jax.jit(make_train_step(model, tx, schedule, config, mesh), in_shardings=in_shardings,
                 out_shardings=(in_shardings[0], in_shardings[2]), donate_argnums=(0,),
                 compiler_options=compiler_options(config))


def compiler_options(config):
  """`jax.jit`'s compiler options for the train step of `config` on the default backend."""
  options = dict(remat_lib.step_compiler_options(config.remat) or {})
  if (accelerator.cuda_capability()
      and models.get_variant(config.model_name, **config.model)['resnet_layers'] is None):
    options.update(NO_COMMAND_BUFFERS)
  return options or None
