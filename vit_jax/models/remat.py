"""Rematerialisation (gradient checkpointing) of encoder blocks and ResNet units.

`config.remat` names a `jax.checkpoint_policies` policy, i.e. which values of a block's
forward pass are kept for the backward pass; the rest are recomputed:
  ''                                  no remat: everything is kept (fastest, most memory)
  'nothing_saveable'                  only block inputs are kept (least memory)
  'dots_saveable'                     matmul/conv outputs kept, elementwise ops recomputed
  'dots_with_no_batch_dims_saveable'  as dots_saveable, except batched dots (attention)
True and False, the field's old values, mean 'nothing_saveable' (what remat=True did) and ''.
The dots policies count the models' own custom-VJP dots (precision.py) as dots, by name;
in a bf16 model they keep each layer's bf16 output instead (`precision.layer_output`).
Measured memory and speed per policy: benchmarks/README.md.

XLA:CPU removes the optimisation barriers that `jax.checkpoint` uses to keep the
recomputation in the backward pass, and its scheduler then runs the recomputation during
the forward pass, where it saves nothing. On that backend each remat'd call therefore also
gets a custom VJP whose backward adds zero times the sum of the incoming cotangent to the
saved values: the recomputation then depends on the cotangent, so it cannot run before
the backward pass reaches the block. The parameters and the gradients are unchanged.
XLA:CPU's memory-optimised scheduler (vit_jax/xla_cpu_flags.py) then still defers the
weight-gradient dots to the end of the step, which keeps every block's recomputed values
alive, so a remat'd step compiles with XLA's default scheduler (`step_compiler_options`).
"""
import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.models import precision

POLICIES = ('nothing_saveable', 'dots_saveable', 'dots_with_no_batch_dims_saveable')
_OLD_VALUES = {True: 'nothing_saveable', False: ''}


def policy_name(remat):
  """The policy name ('' for none) of a config value; ValueError for an unknown one."""
  if isinstance(remat, bool):
    return _OLD_VALUES[remat]
  if remat in ('', *POLICIES):
    return remat
  raise ValueError(f'remat {remat!r} is unknown: set --config.remat to one of '
                   f"'' (off), {', '.join(POLICIES)}")


def compiler_drops_barriers():
  """Whether the backend's compiler removes jax.checkpoint's optimisation barriers."""
  return jax.default_backend() == 'cpu'


def step_compiler_options(remat):
  """`jax.jit` compiler options for a train step of a model under `remat` (a config value)."""
  if policy_name(remat) and compiler_drops_barriers():
    return {'xla_cpu_scheduler_type': 'CPU_SCHEDULER_TYPE_DEFAULT'}
  return None


def checkpoint_policy(name):
  """jax.checkpoint_policies' `name`, whose dots include the models' own (precision.py)."""
  policy = getattr(jax.checkpoint_policies, name)
  names = {
      'dots_saveable': (precision.DOT_NAME, precision.BATCHED_DOT_NAME),
      'dots_with_no_batch_dims_saveable': (precision.DOT_NAME,)
  }.get(name)
  if not names:
    return policy
  return jax.checkpoint_policies.save_from_both_policies(
      policy, jax.checkpoint_policies.save_only_these_names(*names))


def wrap(module_cls, remat, static_argnums=()):
  """`module_cls`, rematerialised under policy `remat` (a config value) unless off.

  Construct and call the result as `module_cls`. `static_argnums` count `self` as 0, as
  in `nn.remat`.
  """
  name = policy_name(remat)
  if not name:
    return module_cls
  remat_cls = nn.remat(module_cls, policy=checkpoint_policy(name), static_argnums=static_argnums)
  if not compiler_drops_barriers():
    return remat_cls

  def construct(*fields, **kwargs):
    module = remat_cls(*fields, **kwargs)
    return lambda *args: _call_after_cotangent(module, static_argnums, args)

  return construct


def _call_after_cotangent(module, static_argnums, args):
  """`module(*args)`, whose backward recomputes only once the output's cotangent exists."""
  is_static = [i + 1 in static_argnums for i in range(len(args))]
  arrays = [a for a, static in zip(args, is_static) if not static]

  def call(mdl, *arrays):
    rest = iter(arrays)
    return mdl(*[a if static else next(rest) for a, static in zip(args, is_static)])

  def forward(mdl, *arrays):
    return nn.vjp(call, mdl, *arrays)  # the output and the VJP, whose leaves are the saved values

  def backward(vjp_fn, cotangent):
    # Float multiplication by zero is not simplified away (0 * nan is nan), so this stays a
    # real dependency; a non-finite cotangent makes the gradients non-finite either way.
    zero = jnp.sum(jax.tree.leaves(cotangent)[0], dtype=jnp.float32) * 0
    vjp_fn = jax.tree.map(
        lambda v: v + zero.astype(v.dtype) if jnp.issubdtype(v.dtype, jnp.inexact) else v, vjp_fn)
    return vjp_fn(cotangent)

  return nn.custom_vjp(call, forward, backward)(module, *arrays)
