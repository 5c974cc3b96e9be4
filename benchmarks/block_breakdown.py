r"""Where the time of a ViT encoder block goes, and what layout/precision choices cost.

  python benchmarks/block_breakdown.py --out /tmp/block_breakdown.json

Times forward+backward (jax.grad of sum of outputs) of one encoder block at ViT-B/16
shapes (batch 8, 197 tokens, D 768, 12 heads) in several variants, interleaved round by
round, and counts ops in the optimised HLO of each:
  vit_jax        vit_jax.models.vit.EncoderBlock as shipped
  attn_bhqd      same maths, q/k/v projected straight to (b, h, q, d) (no 'bqhd' layout)
  fused_qkv      attn_bhqd plus one (D, 3D) projection instead of three
  mlp_only       the block without attention (LN + MLP + residual): the matmul-bound part
  attn_only      LN + attention + residual, as shipped
  attn_dpa       attn_only with the attention core as jax.nn.dot_product_attention (XLA)
It also counts transposes/copies/converts in the whole ViT-B/16 train step's HLO
(f32 and bf16) so a reader can see where layout and precision changes land.
"""
import collections
import re
import time

import bare_step
import flax.linen as nn
import harness
import jax
import jax.numpy as jnp

from vit_jax import models
from vit_jax.models import vit

parser = harness.argument_parser(__doc__)
parser.add_argument('--batch', type=harness.positive_int, default=8)
parser.add_argument('--tokens', type=harness.positive_int, default=197)
parser.add_argument('--hidden', type=harness.positive_int, default=768)
parser.add_argument('--mlp', type=harness.positive_int, default=3072)
parser.add_argument('--heads', type=harness.positive_int, default=12)
parser.add_argument('--dtypes', default='float32',
                    help='float32, bfloat16, or both where their XLA:CPU flags are the same')
parser.add_argument('--reps', type=harness.positive_int, default=3,
                    help='timed calls per variant per round')
parser.add_argument('--rounds', type=harness.positive_int, default=3)
parser.add_argument('--step_hlo', default='ViT-B_16',
                    help='model whose train step HLO is counted ("" skips)')
harness.add_allocator_arg(parser)
parser.add_argument('--out', default='')
args = parser.parse_args()
for _dtype in args.dtypes.split(','):
  if _dtype not in models.DTYPES:
    parser.error(f'--dtypes: {_dtype!r} is unknown: use {",".join(models.DTYPES)}')


class AttnBHQD(nn.Module):
  """Attention with heads-major activations; fused=True: one (D, 3, H, hd) projection."""
  num_heads: int
  dtype: object = jnp.float32
  fused: bool = False

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    hd = d // self.num_heads
    init = nn.initializers.xavier_uniform()
    if self.fused:
      w = self.param('qkv', init, (d, 3, self.num_heads, hd)).astype(self.dtype)
      b = self.param('qkv_bias', nn.initializers.zeros, (3, self.num_heads, hd)).astype(self.dtype)
      qkv = jnp.einsum('bnd,dthe->tbhne', x.astype(self.dtype), w) + b[:, None, :, None]
      q, k, v = qkv[0], qkv[1], qkv[2]
    else:

      def proj(name):
        w = self.param(name, init, (d, self.num_heads, hd)).astype(self.dtype)
        b = self.param(name + '_bias', nn.initializers.zeros,
                       (self.num_heads, hd)).astype(self.dtype)
        return jnp.einsum('bnd,dhe->bhne', x.astype(self.dtype), w) + b[None, :, None]

      q, k, v = proj('query'), proj('key'), proj('value')
    q = q / jnp.sqrt(hd).astype(q.dtype)
    logits = jnp.einsum('bhqe,bhke->bhqk', q, k, preferred_element_type=jnp.float32)
    weights = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
    y = jnp.einsum('bhqk,bhke->bhqe', weights, v)
    wo = self.param('out', init, (self.num_heads, hd, d)).astype(self.dtype)
    bias = self.param('out_bias', nn.initializers.zeros, (d,)).astype(self.dtype)
    return jnp.einsum('bhqe,hed->bqd', y, wo) + bias


class AttnDPA(nn.Module):
  """vit_jax's projections around jax.nn.dot_product_attention (takes 'bqhd' as they give)."""
  num_heads: int
  dtype: object = jnp.float32

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    proj = lambda name: nn.DenseGeneral(
        (self.num_heads, d // self.num_heads), dtype=self.dtype, name=name)
    y = jax.nn.dot_product_attention(
        proj('query')(x),
        proj('key')(x),
        proj('value')(x), implementation='xla')
    return nn.DenseGeneral(d, axis=(-2, -1), dtype=self.dtype, name='out')(y)


class Block(nn.Module):
  variant: str
  dtype: object

  @nn.compact
  def __call__(self, x):
    if self.variant == 'vit_jax':
      return vit.EncoderBlock(args.mlp, args.heads, dtype=self.dtype)(x, True)
    ln = lambda: nn.LayerNorm(epsilon=1e-6, dtype=self.dtype)
    if self.variant != 'mlp_only':
      # attn_only and attn_dpa name their attention alike so they share parameters.
      if self.variant == 'attn_only':
        y = vit.MultiHeadDotProductAttention(args.heads, dtype=self.dtype,
                                             name='attn')(ln()(x), deterministic=True)
      elif self.variant == 'attn_dpa':
        y = AttnDPA(args.heads, self.dtype, name='attn')(ln()(x))
      else:
        y = AttnBHQD(args.heads, self.dtype, fused=self.variant == 'fused_qkv')(ln()(x))
      x = x + y
    if self.variant not in ('attn_only', 'attn_dpa'):
      x = x + vit.MlpBlock(args.mlp, dtype=self.dtype)(ln()(x), deterministic=True)
    return x


def op_counts(hlo_text):
  """Counts of a few op kinds in optimised HLO text (fusion bodies included)."""
  counts = collections.Counter()
  for kind in ('transpose', 'copy', 'convert', 'dot', 'convolution', 'fusion', 'reduce'):
    counts[kind] = len(re.findall(rf'= [^ ]+ {kind}\(', hlo_text))
  return dict(counts)


def main():
  harness.reexec_under_allocator(args.allocator)  # the flags and allocator vit-train runs with
  bare_step.setup(1, args.dtypes.split(','))
  load_start = harness.loadavg()
  variants = ['vit_jax', 'attn_bhqd', 'fused_qkv', 'attn_only', 'attn_dpa', 'mlp_only']
  shape = (args.batch, args.tokens, args.hidden)
  x = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.float32)
  cases = []
  for dtype in args.dtypes.split(','):
    for v in variants:
      m = Block(v, models.DTYPES[dtype])
      params = m.init(jax.random.PRNGKey(0), x)
      f = jax.jit(
          jax.grad(lambda p, x, m=m: jnp.sum(m.apply(p, x).astype(jnp.float32)), argnums=(0, 1)))
      compiled = f.lower(params, x).compile()
      jax.block_until_ready(compiled(params, x))
      cases.append({
          'variant': v,
          'dtype': dtype,
          'fn': compiled,
          'params': params,
          'times': [],
          'hlo': op_counts(compiled.as_text())
      })
  # The dot_product_attention variant must compute the shipped attention (same parameters).
  p_only = next(c['params'] for c in cases if c['variant'] == 'attn_only')
  dpa_diff = float(
      jnp.max(
          jnp.abs(
              Block('attn_dpa', jnp.float32).apply(p_only, x)
              - Block('attn_only', jnp.float32).apply(p_only, x))))
  if dpa_diff > 1e-4:
    raise SystemExit(f'attn_dpa differs from attn_only by {dpa_diff:.2e}: the variant is wrong')
  for _ in range(args.rounds):
    for c in cases:
      best = float('inf')
      for _ in range(args.reps):
        t = time.perf_counter()
        jax.block_until_ready(c['fn'](c['params'], x))
        best = min(best, time.perf_counter() - t)
      c['times'].append(best)

  step_hlo = {}
  if args.step_hlo:
    for dtype in args.dtypes.split(','):
      s = bare_step.BareStep(bare_step.make_config(args.step_hlo, args.batch, dtype=dtype))
      step_hlo[dtype] = op_counts(s.compiled.as_text())
      del s

  load_end = harness.loadavg()
  rows, results = [], []
  for c in cases:
    ref = next(r for r in cases if r['variant'] == 'vit_jax' and r['dtype'] == c['dtype'])
    rel = [t / r for t, r in zip(c['times'], ref['times'])]
    results.append({
        'variant': c['variant'],
        'dtype': c['dtype'],
        'fwd_bwd_s_per_round': c['times'],
        'relative_to_vit_jax_per_round': rel,
        'hlo_op_counts': c['hlo']
    })
    h = c['hlo']
    rows.append([
        c['variant'], c['dtype'],
        harness.fmt_range([1e3 * t for t in c['times']], '.1f'),
        harness.fmt_range(rel, '.2f'), h['transpose'], h['copy'], h['convert'], h['dot']
    ])
  payload = {
      'benchmark': 'block_breakdown',
      'machine': bare_step.machine_info(),
      'args': vars(args),
      'loadavg_start': load_start,
      'loadavg_end': load_end,
      'results': results,
      'attn_dpa_max_abs_diff_vs_attn_only_f32': dpa_diff,
      'train_step_hlo_op_counts': step_hlo
  }
  print(f'\n### one encoder block fwd+bwd, x {shape}\n')
  print(
      harness.markdown_table([
          'variant', 'dtype', 'ms median (min–max)', 'time / vit_jax per round (median, min–max)',
          'transpose', 'copy', 'convert', 'dot'
      ], rows))
  if step_hlo:
    print(f'\n{args.step_hlo} train step (batch {args.batch}) optimised HLO op counts: {step_hlo}')
  print(f'\nloadavg start {load_start[0]:.2f}, end {load_end[0]:.2f}')
  harness.write_json(args.out, payload)


if __name__ == '__main__':
  main()
