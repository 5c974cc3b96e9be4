"""The backward pass of encoder blocks and ResNet units: rematerialisation (gradient
checkpointing), and on XLA:CPU the order of their gradients.

`config.remat` names a `jax.checkpoint_policies` policy, i.e. which values of a block's
forward pass are kept for the backward pass (the rest are recomputed), or 'gelu':
  ''                                  no remat: everything is kept (fastest, most memory)
  'nothing_saveable'                  only block inputs are kept (least memory)
  'dots_saveable'                     matmul/conv outputs kept, elementwise ops recomputed
  'dots_with_no_batch_dims_saveable'  as dots_saveable, except batched dots (attention)
  'gelu'                              no block remat; only the MLPs' GELU is computed again
True and False, the field's old values, mean 'nothing_saveable' (what remat=True did) and ''.
'gelu' keeps each MLP's hidden layer once instead of twice (the GELU's input, not also its
output, the second layer's input: `precision.of_activation`). On a 2-core Zen 5 host the
ViT-Ti/16 b32, ViT-B/16 b8 and R50+ViT-B/16 b8 steps planned 0.10, 0.08 and 0.08 GiB less
in bf16 at 0.90-1.01x the speed, 0.20 GiB less in float32 at 0.94-1.01x (benchmarks/README.md,
fifty-ninth session); float32 with YNNPACK's fusions off planned the same as without. Where
dropout follows the GELU (dropout_rate > 0, in training) the second layer's input is the
dropped output, and the GELU is kept as without remat (vit-train says so at start-up).
The dots policies count the models' own custom-VJP dots (precision.py) as dots, by name;
in a bf16 model they keep each layer's bf16 output instead (`precision.layer_output`).
Measured memory and speed per policy: benchmarks/README.md.

XLA:CPU removes the optimisation barriers that `jax.checkpoint` uses to keep the
recomputation in the backward pass, and its scheduler then runs the recomputation during
the forward pass, where it saves nothing. On that backend each remat'd call therefore also
gets a custom VJP whose backward makes the saved values depend on the incoming cotangent
(`precision.depending_on`), so that the recomputation cannot run before the backward pass
reaches the block. The parameters and the gradients are unchanged.
XLA:CPU's memory-optimised scheduler (vit_jax/xla_cpu_flags.py) then still defers the
weight-gradient dots to the end of the step, which keeps every block's recomputed values
alive, so a remat'd step compiles with XLA's default scheduler (`step_compiler_options`).

Without remat, that scheduler also runs the gradients that only the optimizer reads (the
biases', LayerNorms' and GroupNorms' sums over the batch) at the end of the backward pass,
each keeping its block's cotangents alive until then: at the planned peak of the bf16
R50+ViT-B/16 b8 step, ~0.6 of its 2.28 GiB waited for them. So on the CPU backend
(`parameter_gradients_first`: bf16 models, and float32 ones where YNNPACK fusions run)
each block's backward makes its input's gradient depend on one element of each of its
parameters' gradients (`inputs_after`; float32: the 1-D ones), which then run within the
block's backward: planned 2.04 GiB, and the bf16 steps ran 1.01-1.09x faster; float32
ViT-B/16 b8 1.65 instead of 1.75 GiB at 0.96-1.03x the speed (benchmarks/README.md). The
gradients are unchanged.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax import xla_cpu_flags
from vit_jax.models import precision

GELU = 'gelu'
POLICIES = ('nothing_saveable', 'dots_saveable', 'dots_with_no_batch_dims_saveable', GELU)
_OLD_VALUES = {True: 'nothing_saveable', False: ''}


def policy_name(remat):
  """The policy name ('' for none) of a config value; ValueError for an unknown one."""
  if isinstance(remat, bool):
    return _OLD_VALUES[remat]
  if remat in ('', *POLICIES):
    return remat
  raise ValueError(f'remat {remat!r} is unknown: set --config.remat to one of '
                   f"'' (off), {', '.join(POLICIES)}")


def block_policy(remat):
  """The jax.checkpoint policy name of whole blocks under `remat` ('' for none)."""
  name = policy_name(remat)
  return '' if name == GELU else name


def recomputes_gelu(remat):
  """Whether the MLPs compute their GELU again in the backward pass (policy 'gelu')."""
  return policy_name(remat) == GELU


def compiler_drops_barriers():
  """Whether the backend's compiler removes jax.checkpoint's optimisation barriers."""
  return jax.default_backend() == 'cpu'


def gelu_remat_note(remat, dropout_rate):
  """What a run under `remat` of a model whose MLPs drop out at `dropout_rate` (None: no
  MLPs) should be told: that 'gelu' recomputes nothing there; else None."""
  if not recomputes_gelu(remat):
    return None
  if dropout_rate is None:
    return ("remat 'gelu' recomputes nothing in this model, which has no MLP: set "
            "--config.remat to another policy (models/remat.py)")
  if dropout_rate > 0:
    return (f"remat 'gelu' recomputes nothing in training here: dropout follows each GELU "
            f"(dropout_rate {dropout_rate}), so the GELU's output is kept: set "
            "--config.model.dropout_rate=0 or --config.remat to another policy")
  return None


def step_compiler_options(remat):
  """`jax.jit` compiler options for a train step of a model under `remat` (a config value)."""
  if block_policy(remat) and compiler_drops_barriers():
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


def wrap(module_cls, remat, dtype, static_argnums=()):
  """`module_cls`, rematerialised under policy `remat` (a config value) unless off, and
  where `parameter_gradients_first(dtype)` with its parameters' gradients computed before
  its inputs' (module doc).

  Construct and call the result as `module_cls`. `static_argnums` count `self` as 0, as
  in `nn.remat`.
  """
  name = block_policy(remat)
  if name:
    module_cls = nn.remat(module_cls, policy=checkpoint_policy(name), static_argnums=static_argnums)
  recompute_after_cotangent = bool(name) and compiler_drops_barriers()
  # A remat'd step compiles under XLA's default scheduler, which does not defer them: there
  # the dependence planned the same memory and cost 2-3% (benchmarks/README.md).
  # None, or whether only the vectors among the parameters' gradients are tied (inputs_after).
  gradients_first = (not precision.is_mixed(dtype)
                     if not name and parameter_gradients_first(dtype) else None)
  if not recompute_after_cotangent and gradients_first is None:
    return module_cls

  def construct(*fields, **kwargs):
    module = module_cls(*fields, **kwargs)
    return lambda *args: _call_ordered(module, static_argnums, args, recompute_after_cotangent,
                                       gradients_first)

  return construct


def parameter_gradients_first(dtype):
  """Whether a block of a model computing in `dtype` computes its parameters' gradients
  before its input's (module doc), on the CPU backend: bfloat16, and float32 where XLA:CPU
  runs YNNPACK fusions. float32 with the fusions off (xla_cpu_flags.py's choice on some
  hosts) ran 0.90-0.97x."""
  return jax.default_backend() == 'cpu' and (precision.is_mixed(dtype)
                                             or xla_cpu_flags.ynnpack_fusions_on())


def _call_ordered(module, static_argnums, args, recompute_after_cotangent, gradients_first):
  """`module(*args)`, whose backward recomputes only once the output's cotangent exists,
  and/or computes the parameters' gradients before the inputs' (`gradients_first` not None:
  inputs_after's `vectors_only`)."""
  is_static = [i + 1 in static_argnums for i in range(len(args))]
  arrays = [a for a, static in zip(args, is_static) if not static]

  def call(mdl, *arrays):
    rest = iter(arrays)
    return mdl(*[a if static else next(rest) for a, static in zip(args, is_static)])

  def forward(mdl, *arrays):
    return nn.vjp(call, mdl, *arrays)  # the output and the VJP, whose leaves are the saved values

  def backward(vjp_fn, cotangent):
    if recompute_after_cotangent:
      # A non-finite cotangent makes the gradients non-finite either way.
      first = jax.tree.leaves(cotangent)[0]
      vjp_fn = jax.tree.map(
          lambda v: precision.depending_on(v, first)
          if jnp.issubdtype(v.dtype, jnp.inexact) else v, vjp_fn)
    params_t, *inputs_t = vjp_fn(cotangent)
    if gradients_first is not None:
      inputs_t = inputs_after(inputs_t, params_t, vectors_only=gradients_first)
    return (params_t, *inputs_t)

  return nn.custom_vjp(call, forward, backward)(module, *arrays)


def inputs_after(inputs_t, params_t, vectors_only=False):
  """The input cotangents `inputs_t`, as values that XLA computes after the leaves of the
  parameter gradients `params_t` (one element of each ties it); `vectors_only`: after its
  1-D leaves (the biases', LayerNorms' and GroupNorms' sums over the batch). A float32 model
  ties only those: tying its kernels' and the attention's 2-D q, k, v biases' too planned
  more (ViT-Ti/16 b32 1.07 instead of 1.05 GiB, ViT-B/16 b8 1.67 instead of 1.65); a bf16
  model ties all, which planned the same as the vectors alone and ran 1.00-1.02x faster
  (ViT-Ti/16 b32; benchmarks/README.md, fifty-sixth session)."""
  firsts = [
      leaf.ravel()[:1].astype(jnp.float32) for leaf in jax.tree.leaves(params_t)
      if leaf.ndim == 1 or not vectors_only
  ]
  if not firsts:
    return inputs_t
  return [precision.depending_on(t, jnp.concatenate(firsts)) for t in inputs_t]
