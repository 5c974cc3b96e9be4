"""Rematerialisation (gradient checkpointing) of encoder blocks and ResNet units.

`config.remat` names a `jax.checkpoint_policies` policy, i.e. which values of a block's
forward pass are kept for the backward pass; the rest are recomputed:
  ''                                  no remat: everything is kept (fastest, most memory)
  'nothing_saveable'                  only block inputs are kept (least memory)
  'dots_saveable'                     matmul/conv outputs kept, elementwise ops recomputed
  'dots_with_no_batch_dims_saveable'  as dots_saveable, except batched dots (attention)
True and False, the field's old values, mean 'nothing_saveable' (what remat=True did) and ''.
Measured memory and speed per policy: benchmarks/README.md. On XLA:CPU remat saves
little: the compiler removes the optimisation barriers that keep the recomputation in
the backward pass, and its scheduler then runs it in the forward pass.
"""
import flax.linen as nn
import jax

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


def wrap(module_cls, remat, **remat_kwargs):
  """`module_cls`, rematerialised under policy `remat` (a config value) unless off."""
  name = policy_name(remat)
  if not name:
    return module_cls
  return nn.remat(module_cls, policy=getattr(jax.checkpoint_policies, name), **remat_kwargs)
