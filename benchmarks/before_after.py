r"""The train step with one of vit_jax's backend-specific choices against the step without
it: the evidence for that choice on this host. `--change`:

  ordered_dots      vit_jax/models/precision.py's ordered dots. float32: flax's own dots
                    (what float32 models had before) vs `float32_dot_general`; bfloat16:
                    every weight gradient as lhs^T g vs `_cotangent_transposed_is_cheaper`'s
                    order. The JSON counts each side's (g^T x)^T weight gradients.
  lean_activations  vit_jax/models/activations.py's GELU and softmax vs jax.nn's, whose
                    autodiff keeps more arrays for the backward pass.
  max_pool_slices   pooling.py's max pooling of the ResNet stems (strided slices, a
                    backward of pads) vs nn.max_pool (reduce-window, select-and-scatter).
  gelu_in_float32   (bfloat16) activations.py's GELU computed in float32 and rounded once
                    vs jax.nn.gelu on bf16 operands, which rounds each operation.
  lean_group_norm   vit_jax/models/normalization.py's GroupNorm and activations.py's
                    ReLU (the ResNets') vs flax's and jax.nn's, whose autodiff keeps
                    float32 arrays of the norm's input size and the ReLU's input.
  group_norm_channel_sums
                    normalization.py's GroupNorm statistics as each channel's sums over
                    the positions, then over the group's channels, vs one reduction over
                    both (flax's, as shipped before: flax's GroupNorm for float32, the
                    statistics so in normalization.py's bf16 path).
  lean_attention    vit_jax/models/attention.py's core, which keeps q, k and v and
                    recomputes the attention weights in the backward pass, vs autodiff of
                    the same forward, which keeps the weights.
  attention_chunks  (float32) attention.py's core run over batch_chunks chunks of the batch
                    vs over the whole batch at once. The JSON counts each side's dots.
  kernels_recast    (bfloat16) precision.py's bf16 copy of each large float32 kernel
                    (a quarter or more of its dot's input) made again for the backward
                    pass (XLA:CPU) vs the forward pass's copy, which XLA keeps alive until
                    the backward pass reads it.
  prompt_weight_gradients
                    precision.py's dependence of each input gradient on its layer's weight
                    gradient (XLA:CPU) vs none, where XLA:CPU's memory-optimised scheduler
                    runs every weight-gradient dot at the end of the backward pass.
  parameter_gradients_first
                    remat.py's dependence of each encoder block's and ResNet unit's input
                    gradient on its parameter gradients (XLA:CPU; bf16: all, float32 where
                    YNNPACK fusions run: the 1-D ones) vs none, where the scheduler runs
                    the bias, LayerNorm and GroupNorm gradients (sums over the batch) at
                    the end of the backward pass.
  conv_as_dot       vit_jax/models/conv_as_dot.py's convolutions as dots (the patch
                    embedding always; bf16 3x3 convolutions on CPU) vs XLA convolutions
                    (flax's nn.Conv for the embedding, lax's for the ResNets' kxk).
  bf16_patches      (bfloat16) conv_as_dot.py's im2col patches concatenated as 16-bit
                    patterns vs jnp.concatenate, which XLA:CPU runs in float32.
  fused_attention   (bfloat16, GPU) attention.py's cuDNN fused attention vs the unfused
                    core, which writes the (batch, heads, tokens, tokens) weights out.
  tokens_padded_once
                    (bfloat16, GPU) vit.py's encoder padding an odd token count (ViT's
                    196 + 1) to an even one once for all its blocks' cuDNN attention vs
                    each attention padding its q, k and v and slicing its output.
  mixed_dots        (bfloat16) precision.py's bf16 x bf16 -> f32 dots, custom VJPs, vs
                    flax's and XLA's own bf16 dots (bf16 results, the backend's own
                    accumulation), whatever precision.is_mixed ships for the backend: the
                    question for TPU and GPU, where bytes cost more (on an NVIDIA GPU
                    the bf16 results ship).
  no_command_buffers
                    (an NVIDIA GPU) the step compiled without XLA's command buffers (CUDA
                    graphs) vs with them, XLA's default, whatever vit_jax.step ships for
                    the model. Run it both with JAX's preallocation (vit-train's) and
                    XLA_PYTHON_CLIENT_PREALLOCATE=false.

Both sides are traced and compiled in one process under the XLA:CPU flags the CLI uses for
the dtype (one --dtypes per run) and the host allocator it preloads (--allocator, as
vs_pytorch.py), then timed in alternating rounds (A B, B A, ...); the ratio is taken per
round.

  python benchmarks/before_after.py --change ordered_dots --dtypes float32 --rounds 3
  python benchmarks/before_after.py --change lean_activations --dtypes bfloat16
  python benchmarks/before_after.py --change lean_attention --dtypes bfloat16
  XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= python benchmarks/before_after.py
"""
import contextlib
import statistics

import bare_step
import flax.linen as nn
import harness
import jax
import jax.numpy as jnp

from vit_jax import step as step_lib
from vit_jax.models import accelerator
from vit_jax.models import activations
from vit_jax.models import attention
from vit_jax.models import conv_as_dot
from vit_jax.models import normalization
from vit_jax.models import pooling
from vit_jax.models import precision
from vit_jax.models import remat
from vit_jax.models import vit

parser = harness.argument_parser(__doc__)
harness.add_model_args(parser, dtypes='float32', steps=3)
parser.add_argument(
    '--change', default='ordered_dots',
    choices=('ordered_dots', 'lean_activations', 'gelu_in_float32', 'max_pool_slices',
             'lean_group_norm', 'group_norm_channel_sums', 'lean_attention', 'attention_chunks',
             'kernels_recast', 'prompt_weight_gradients', 'parameter_gradients_first',
             'conv_as_dot', 'bf16_patches', 'fused_attention', 'tokens_padded_once', 'mixed_dots',
             'no_command_buffers'))
parser.add_argument('--remat', default='', help="one remat policy for both sides ('' off)")
harness.add_allocator_arg(parser)
parser.add_argument('--out', default='')
args = parser.parse_args()


@contextlib.contextmanager
def _patched(module, replacements):
  """While tracing: `module`'s attributes replaced (name -> value)."""
  shipped = {name: getattr(module, name) for name in replacements}
  for name, value in replacements.items():
    setattr(module, name, value)
  try:
    yield
  finally:
    for name, value in shipped.items():
      setattr(module, name, value)


@contextlib.contextmanager
def _together(*contexts):
  """All of `contexts` at once."""
  with contextlib.ExitStack() as stack:
    for context in contexts:
      stack.enter_context(context)
    yield


def _before(change, dtype):
  """A context in which the models trace as they did before `change`, for `dtype`."""
  if change == 'lean_activations':
    return _patched(
        activations, {
            'gelu': lambda x: jax.nn.gelu(x, approximate=True),
            'softmax': lambda x: jax.nn.softmax(x, axis=-1)
        })
  if change == 'gelu_in_float32':
    return _patched(activations, {'gelu_value': lambda x: jax.nn.gelu(x, approximate=True)})
  if change == 'max_pool_slices':
    return _patched(
        pooling, {
            'max_pool': lambda x, window, stride, padding: nn.max_pool(
                x, (window, window), strides=(stride, stride), padding=padding)
        })
  if change == 'lean_group_norm':
    return _together(_patched(normalization, {'GroupNorm': nn.GroupNorm}),
                     _patched(activations, {'relu': jax.nn.relu}))
  if change == 'group_norm_channel_sums':
    if jnp.dtype(dtype) == jnp.float32:
      return _patched(normalization, {'GroupNorm': nn.GroupNorm})
    return _patched(normalization, {'_statistics': _grouped_statistics})
  if change == 'lean_attention':
    return _patched(
        attention,
        {'core': lambda q, k, v, dtype: attention.values(attention.weights(q, k, dtype), v, dtype)})
  if change == 'attention_chunks':
    return _patched(attention, {'batch_chunks': lambda batch, dtype: 1})
  if change == 'kernels_recast':
    return _patched(precision,
                    {'kernel_for_backward': lambda kernel, g, input_size, compute_dtype: kernel})
  if change == 'prompt_weight_gradients':
    return _patched(precision, {'after_weight_gradient': lambda d_lhs, d_rhs: d_lhs})
  if change == 'parameter_gradients_first':
    return _patched(remat,
                    {'inputs_after': lambda inputs_t, params_t, vectors_only=False: inputs_t})
  if change == 'conv_as_dot':
    return _conv_before()
  if change == 'bf16_patches':
    return _patched(conv_as_dot,
                    {'concatenate_channels': lambda pieces: jnp.concatenate(pieces, axis=-1)})
  if change in ('fused_attention', 'tokens_padded_once'):
    if not attention.fuses(dtype, 64):
      raise SystemExit(f'--change {change}: {dtype} on {jax.default_backend()} is not '
                       'fused; pass --dtypes bfloat16 on an NVIDIA GPU (Ampere or later)')
    if change == 'tokens_padded_once':
      return _patched(vit, {'pads_tokens_once': lambda fused, tokens: False})
    return _patched(attention, {'fuses': lambda dtype, head_dim: False})
  if change == 'no_command_buffers':
    return _step_options(command_buffers=True)
  if change == 'mixed_dots':
    return _patched(precision, {'is_mixed': lambda d: False})
  if jnp.dtype(dtype) == jnp.float32:
    shipped = precision.dot_general_for
    return _patched(
        precision,
        {'dot_general_for': lambda d: None if jnp.dtype(d) == jnp.float32 else shipped(d)})
  return _patched(precision, {'_cotangent_transposed_is_cheaper': lambda *unused: False})


def _grouped_statistics(x, groups):
  """normalization._statistics as flax takes them: one reduction over the positions and
  the group's channels."""
  n, positions, channels = x.shape
  x = x.astype(jnp.float32).reshape(n, positions, groups, channels // groups)
  mean = jnp.mean(x, (1, 3))
  return mean, jnp.maximum(0.0, jnp.mean(jnp.square(x), (1, 3)) - jnp.square(mean))


def _after(change, dtype):
  """A context in which the models trace and compile as `change` has them: as shipped,
  except for a change that an accelerator session measures either way, whatever ships."""
  if change == 'no_command_buffers':
    if not accelerator.cuda_capability():
      raise SystemExit('--change no_command_buffers: XLA:GPU\'s command buffers need an NVIDIA '
                       f'GPU; the backend is {jax.default_backend()}')
    return _step_options(command_buffers=False)
  if change == 'mixed_dots':
    if jnp.dtype(dtype) != jnp.bfloat16:
      raise SystemExit('--change mixed_dots compares bfloat16 steps: pass --dtypes bfloat16')
    return _patched(precision, {'is_mixed': lambda d: jnp.dtype(d) == jnp.bfloat16})
  return contextlib.nullcontext()


def _step_options(command_buffers):
  """The step compiled with or without XLA:GPU's command buffers, whatever the model."""
  shipped = step_lib.compiler_options

  def options(config):
    kept = {
        k: v for k, v in (shipped(config) or {}).items() if k not in step_lib.NO_COMMAND_BUFFERS
    }
    return (kept if command_buffers else {**kept, **step_lib.NO_COMMAND_BUFFERS}) or None

  return _patched(step_lib, {'compiler_options': options})


@contextlib.contextmanager
def _conv_before():
  conv = lambda features, p, dtype, name: nn.Conv(features, (p, p), strides=(p, p), padding='VALID',
                                                  dtype=dtype, name=name)
  with _patched(vit, {'PatchEmbedding': conv}), _patched(conv_as_dot,
                                                         {'im2col_pays': lambda *unused: False}):
    yield


def _bf16_result_dots(stablehlo):
  return sum('stablehlo.dot_general' in line and line.rstrip().endswith('xbf16>')
             for line in stablehlo.splitlines())


def _per_side(steps, value):
  """{side: value(its BareStep)} for the sides in `steps` ({side: BareStep})."""
  return {side: value(step) for side, step in steps.items()}


def _count(steps, text):
  """How often `text` is in each side's lowered step: before XLA's passes, since XLA:CPU
  drops some ops (barriers) once it has compiled."""
  return _per_side(steps, lambda step: step.stablehlo.count(text))


def _gib(value):
  return '?' if value is None else f'{value:.2f}'


def main():
  harness.reexec_under_allocator(args.allocator)
  dtypes = args.dtypes.split(',')
  bare_step.setup(1, dtypes)
  load_start = harness.loadavg()
  results = []
  for model, batch in harness.model_batches(args):
    for dtype in dtypes:
      config = bare_step.make_config(model, batch, dtype=dtype, image_size=args.image_size,
                                     remat=args.remat,
                                     model_overrides=bare_step.overrides(args.override))
      with _after(args.change, dtype):  # first: it may refuse before anything compiles
        after = bare_step.BareStep(config, keep_stablehlo=True)
      with _before(args.change, dtype):
        before = bare_step.BareStep(config, keep_stablehlo=True)
      before.run(1)
      after.run(1)
      img_s = {'before': [], 'after': []}
      for r in range(args.rounds):
        sides = [('before', before), ('after', after)]
        for side, step in sides if r % 2 == 0 else sides[::-1]:
          img_s[side].append(batch / statistics.median(step.run(args.steps)))
        print(f'{model} b{batch} {dtype}: round {r + 1}/{args.rounds} done', flush=True)
      steps = {'before': before, 'after': after}
      results.append({
          'model': model,
          'batch': batch,
          'dtype': dtype,
          'img_s': img_s,
          'ratio_per_round': [b / a for a, b in zip(img_s['before'], img_s['after'])],
          'xla_memory_gib': _per_side(steps, lambda step: step.memory_gib),
          'compile_s': _per_side(steps, lambda step: step.compile_s),
          # The (g^T x)^T weight gradients in each step (precision.py's barrier).
          'barriers': _count(steps, 'optimization_barrier'),
          # The dots in each step (attention_chunks: the core's, once per chunk).
          'dots': _count(steps, 'stablehlo.dot_general'),
          # The XLA convolutions left in each step (conv_as_dot makes dots of some).
          'convolutions': _count(steps, 'stablehlo.convolution'),
          # The reduce-windows (max_pool_slices: nn.max_pool's, before only on the CPU).
          'reduce_windows': _count(steps, 'stablehlo.reduce_window'),
          # cuDNN's fused attention calls (fused_attention: one per block, after only).
          'fused_attention_calls': _count(steps, 'cudnn$fmha'),
          # The dots with bfloat16 results (mixed_dots: precision.py's have float32 ones).
          'bf16_result_dots': _per_side(steps, lambda step: _bf16_result_dots(step.stablehlo))
      })
  load_end = harness.loadavg()
  rows = [[
      x['model'], x['batch'], x['dtype'],
      harness.fmt_range(x['img_s']['before']),
      harness.fmt_range(x['img_s']['after']), ', '.join(f'{v:.3f}' for v in x['ratio_per_round']),
      ' / '.join(_gib(x['xla_memory_gib'][side]) for side in ('before', 'after'))
  ] for x in results]
  print(f'\n### train step: {args.change}, after vs before\n')
  print(
      harness.markdown_table([
          'model', 'batch', 'dtype', 'img/s before', 'img/s after', 'after / before per round',
          'XLA planned GiB before / after'
      ], rows))
  print(f'\nXLA_FLAGS: {bare_step.machine_info()["xla_flags"]!r}')
  print(bare_step.machine_info()['host_allocator'])
  print(f'loadavg start {load_start[0]:.2f}, end {load_end[0]:.2f}')
  harness.write_json(
      args.out, {
          'benchmark': 'before_after',
          'change': args.change,
          'args': vars(args),
          'machine': bare_step.machine_info(),
          'loadavg_start': load_start,
          'loadavg_end': load_end,
          'results': results
      })


if __name__ == '__main__':
  main()
