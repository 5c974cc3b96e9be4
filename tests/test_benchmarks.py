"""Smoke test: each benchmark script runs end to end with tiny settings and writes its JSON;
no script shadows a vit_jax module."""
import gc
import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import harmless_preload
from tests.conftest import with_flags
from vit_jax import cpu_features
from vit_jax import host_memory
from vit_jax.models import accelerator
from vit_jax.models import attention

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    '--image_size', '32', '--override', 'num_layers=1', '--override', 'hidden_size=48',
    '--override', 'mlp_dim=96', '--override', 'num_heads=2'
]


def _run(script, *flags, tmp_path):
  out = tmp_path / f'{script}.json'
  # The scripts choose their device count; the XLA:CPU flags are the fixed table (no probe).
  env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2', 'VIT_JAX_XLA_CPU_FLAGS': '1'}
  env.pop('XLA_FLAGS', None)
  proc = subprocess.run(
      [sys.executable,
       os.path.join(REPO, 'benchmarks', f'{script}.py'), *flags, '--out',
       str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert '| ' in proc.stdout  # the markdown table
  payload = json.loads(out.read_text())
  assert len(payload['loadavg_start']) == 3 and len(payload['loadavg_end']) == 3
  return payload


def test_train_step(tmp_path):
  library = harmless_preload()  # stands in for jemalloc, as in test_allocator
  p = _run('train_step', '--models', 'ViT-Ti_16', '--batch', '2', '--dtypes', 'float32', '--steps',
           '2', '--rounds', '3', '--pause_ms', '1', '--allocator', library, *TINY,
           tmp_path=tmp_path)
  assert p['machine']['host_allocator'].startswith(f'host allocator: {library}, preloaded')
  r = p['results'][0]
  assert r['img_s_median'] > 0 and r['flops_per_step_analytic'] > 0
  assert r['flops_per_step_xla'] >= r['flops_per_step_analytic']
  assert r['peak'] == 'measured' and 0 < min(r['mfu_per_round']) <= max(r['mfu_per_round']) < 1
  # Each round's peak is the best timed so far, as the loop takes the better of its two.
  peaks = r['peak_flop_s_per_round']
  assert len(peaks) == 3 and peaks == sorted(peaks), peaks
  assert r['program_host_mib'] > 5  # this one-block step's program: 14-15 MiB measured


@pytest.mark.skipif(importlib.util.find_spec('torch') is not None, reason='PyTorch is installed')
def test_vs_pytorch_without_pytorch_names_the_install():
  """It had ended in the worker's ModuleNotFoundError and a BrokenPipeError."""
  proc = subprocess.run([
      sys.executable,
      os.path.join(REPO, 'benchmarks', 'vs_pytorch.py'), '--models', 'ViT-Ti_16', '--steps', '1'
  ], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert (proc.returncode, proc.stderr) == (
      1, "vs_pytorch.py: PyTorch is not installed: pip install -c constraints.txt '.[bench]'\n")
  # device_time.py runs without it too, and says how (its default compares with PyTorch).
  assert _refusal('device_time', '--steps', '1') == (
      "device_time.py: PyTorch is not installed: pip install -c constraints.txt '.[bench]', or "
      'run without it: --torch none')


def test_vs_pytorch(tmp_path):
  pytest.importorskip('torch')
  library = harmless_preload()  # stands in for jemalloc, as in test_allocator
  p = _run('vs_pytorch', '--models', 'ViT-Ti_16', '--batch', '2', '--dtypes', 'float32', '--steps',
           '2', '--rounds', '1', '--allocator', library, *TINY, tmp_path=tmp_path)
  assert p['jax_host_allocator'].startswith(f'host allocator: {library}, preloaded at start-up')
  assert p['torch_ld_preload'] == ''  # the worker runs as PyTorch users run it
  assert p['torch_device'] == 'cpu'  # auto: where JAX runs
  r = p['results'][0]
  assert r['jax_params'] == r['torch_params']
  assert len(r['ratio_per_round']) == 1


def test_vs_pytorch_compiled(tmp_path):
  """--torch_compile times PyTorch's compiled model, and says so."""
  pytest.importorskip('torch')
  p = _run('vs_pytorch', '--models', 'ViT-Ti_16', '--batch', '2', '--steps', '2', '--rounds', '1',
           '--torch_compile', *TINY, tmp_path=tmp_path)
  r = p['results'][0]
  assert r['torch_impl'].endswith(', torch.compile')
  assert r['jax_params'] == r['torch_params'] and r['ratio_per_round'][0] > 0


def test_vs_pytorch_device_mismatch():
  """PyTorch on a GPU against JAX on the CPU is no comparison: one line that names the fix."""
  pytest.importorskip('torch')
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'VIT_JAX_XLA_CPU_FLAGS': '1'}
  proc = subprocess.run([
      sys.executable,
      os.path.join(REPO, 'benchmarks', 'vs_pytorch.py'), '--torch_device', 'cuda', '--models',
      'ViT-Ti_16'
  ], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1].endswith(
      '--torch_device cuda: JAX runs on cpu here; time both on one kind of device '
      '(leave --torch_device auto)')


def test_loop(tmp_path):
  p = _run('loop', '--batch', '2', '--steps', '3', '--rounds', '1', '--images', '8', '--jpeg_size',
           '40,48', '--log_every', '1', '--checkpoint_every', '0', '--normal_priority_too', *TINY,
           tmp_path=tmp_path)
  assert p['loop_img_s_per_round'][0] > 0 and p['bare_img_s_per_round'][0] > 0
  assert p['normal_priority_img_s_per_round'][0] > 0


def test_loop_cpu_over_bare(monkeypatch):
  # A loop that used less CPU than the bare step reads as a minus, not as '+-'.
  loop = _benchmark_module(monkeypatch, 'loop')
  assert loop.cpu_over_bare([0.9, 1.03, 2.0], [1.0, 1.0, 2.0]) == '+0.0% (-10.0%–+3.0%)'


def test_bare_step_keeps_only_the_compiled_step(monkeypatch):
  # As the loop does: what built the step (its lowering, JAX's MeshComputation with the
  # StableHLO module, and JAX's traces) is given back once compiled: held, it adds to the
  # peak RSS set beside PyTorch's. The lowering's text only on request.
  bare_step = _benchmark_module(monkeypatch, 'bare_step')
  drops = []
  drop_traces = host_memory.drop_traces
  monkeypatch.setattr(host_memory, 'drop_traces', lambda: drops.append(1) or drop_traces())
  config = bare_step.make_config(
      'ViT-Ti_16', 2, image_size=32, model_overrides={
          'num_layers': 1,
          'hidden_size': 48,
          'mlp_dim': 96,
          'num_heads': 2
      })

  def lowerings():
    gc.collect()
    return [
        len(o.as_text()) for o in gc.get_objects()
        if type(o).__name__ in ('Lowered', 'MeshComputation')
    ]

  before = lowerings()
  kept = bare_step.BareStep(config, heap_wait=False, keep_stablehlo=True)
  assert 'stablehlo.dot_general' in kept.stablehlo
  step = bare_step.BareStep(config, heap_wait=False)
  assert step.stablehlo is None and step.run(1)[0] > 0
  # Nothing as large as the step's module is left (JAX's own small ones may come and go).
  assert max(lowerings(), default=0) < len(kept.stablehlo) / 4, (before, lowerings())
  assert len(drops) == 2


def test_input_speed(tmp_path):
  p = _run('input_speed', '--images', '16', '--jpeg_size', '40,48', '--batch', '4', '--batches',
           '2', '--rounds', '1', '--image_size', '32', tmp_path=tmp_path)
  assert p['train_img_s_median'] > 0 and p['eval_img_s_median'] > 0


def test_checkpoint_save(tmp_path):
  p = _run('checkpoint_save', '--models', 'ViT-Ti_16', '--rounds', '1', '--override',
           'num_layers=1', tmp_path=tmp_path)
  r = p['results'][0]
  packed, itself = r['runs']['packed'][0], r['runs']['as itself'][0]
  # One block's parameters and momentum, and the step: packed as a float32 and an int32 buffer.
  assert itself['saved_arrays'] == r['arrays'] > 30 and packed['saved_arrays'] == 2
  assert packed['total_cpu_s'] >= packed['call_cpu_s'] > 0 and packed['disk_mb'] > 0
  assert len(r['ratio_cpu_per_round']) == 1


def test_ynnpack(tmp_path):
  p = _run('ynnpack', '--models', 'ViT-Ti_16', '--batch', '2', '--steps', '1', '--rounds', '1',
           '--probe_rounds', '0', *TINY, tmp_path=tmp_path)
  r = p['results'][0]
  assert 'ynn_fusion_type' in r['xla_flags']['ynnpack off']
  assert 'ynn_fusion_type' not in r['xla_flags']['xla defaults']
  assert r['cli_side'] == 'ynnpack off'  # float32, the fixed table
  assert len(r['ratio_per_round']) == 1 and r['ratio_per_round'][0] > 0


def test_cpu_devices(tmp_path):
  library = harmless_preload()  # stands in for jemalloc, as in test_allocator
  p = _run('cpu_devices', '--models', 'ViT-Ti_16', '--batch', '2', '--steps', '1', '--rounds', '1',
           '--allocator', library, *TINY, tmp_path=tmp_path)
  assert p['ld_preload'] == library
  r = p['results'][0]
  assert r['device_count'] == {'1': [1], '2': [2]}  # (JSON's keys are strings)
  assert r['img_s']['1'][0] > 0 and r['peak_rss_gib']['2'][0] > 0
  assert len(r['ratio_per_round']) == 1 and r['ratio_per_round'][0] > 0


def test_bf16_over_f32(tmp_path):
  p = _run('bf16_over_f32', '--models', 'ViT-Ti_16', '--batch', '2', '--steps', '1', '--rounds',
           '2', '--devices', '2', *TINY, tmp_path=tmp_path)
  r = p['results'][0]
  assert r['device_count'] == 2  # both sides on the host split in two, as asked
  # Each dtype in its own process, under its own flags: the fixed table's differ.
  assert 'ynn_fusion_type' in r['xla_flags']['float32']
  assert 'ynn_fusion_type' not in r['xla_flags']['bfloat16']
  ratios = [b / f for f, b in zip(r['img_s']['float32'], r['img_s']['bfloat16'])]
  assert r['ratio_per_round'] == ratios and len(ratios) == 2
  assert r['target_met'] == (r['ratio_median'] >= p['target'] == 1.6)
  assert min(r['mfu']['bfloat16']) > 0 and min(r['peak_rss_gib']['float32']) > 0


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_before_after_ordered_dots(tmp_path, dtype):
  # 64 images of 5 tokens: the MLP output layer's weight gradient is taken as (g^T x)^T.
  p = _run('before_after', '--change', 'ordered_dots', '--models', 'ViT-Ti_16', '--batch', '64',
           '--dtypes', dtype, '--steps', '1', '--rounds', '2', *TINY, tmp_path=tmp_path)
  r = p['results'][0]
  assert r['barriers']['before'] == 0 and r['barriers']['after'] > 0, r['barriers']
  assert len(r['ratio_per_round']) == 2 and min(r['ratio_per_round']) > 0


def test_before_after_gelu_in_float32(tmp_path):
  p = _run('before_after', '--change', 'gelu_in_float32', '--models', 'ViT-Ti_16', '--batch', '2',
           '--dtypes', 'bfloat16', '--steps', '1', '--rounds', '1', *TINY, tmp_path=tmp_path)
  r = p['results'][0]
  assert p['change'] == 'gelu_in_float32' and len(r['ratio_per_round']) == 1
  assert min(r['ratio_per_round']) > 0


def test_before_after_attention_chunks(tmp_path):
  # One block, 4 images: after, the core's 2 forward and 5 backward dots once per image.
  p = _run('before_after', '--change', 'attention_chunks', '--models', 'ViT-Ti_16', '--batch', '4',
           '--steps', '1', '--rounds', '1', *TINY, tmp_path=tmp_path)
  r = p['results'][0]
  assert p['change'] == 'attention_chunks' and min(r['ratio_per_round']) > 0
  assert min(r['compile_s'].values()) > 0
  if jax.default_backend() == 'cpu':  # one CPU device: the core in 4 chunks after
    assert r['dots']['after'] - r['dots']['before'] == 3 * 7, r['dots']


def test_before_after_lean_activations(tmp_path):
  # 257 tokens a block (TINY's 5 are too few for the saved values to make the peak).
  p = _run('before_after', '--change', 'lean_activations', '--models', 'ViT-Ti_16', '--batch', '4',
           '--steps', '1', '--rounds', '1', '--image_size', '64', '--override', 'num_layers=3',
           '--override', 'patch_size=4', tmp_path=tmp_path)
  assert p['change'] == 'lean_activations'
  r = p['results'][0]
  assert r['xla_memory_gib']['after'] < r['xla_memory_gib']['before'], r['xla_memory_gib']


@pytest.mark.parametrize('change', ['lean_attention', 'prompt_weight_gradients', 'kernels_recast'])
def test_before_after_memory_changes(tmp_path, change):
  # As lean_activations: 257 tokens a block, so that the saved values make the peak.
  p = _run('before_after', '--change', change, '--models', 'ViT-Ti_16', '--batch', '4', '--dtypes',
           'bfloat16', '--steps', '1', '--rounds', '1', '--image_size', '64', '--override',
           'num_layers=3', '--override', 'patch_size=4', tmp_path=tmp_path)
  assert p['change'] == change
  r = p['results'][0]
  if jax.default_backend() != 'cpu':
    return  # both changes are made on the CPU backend only: the two steps are the same
  assert r['xla_memory_gib']['after'] < r['xla_memory_gib']['before'], r['xla_memory_gib']


@pytest.mark.parametrize('change', ['parameter_gradients_first', 'bf16_patches', 'max_pool_slices'])
def test_before_after_resnet_changes(tmp_path, change):
  # A hybrid with one ResNet stage (bf16: its 3x3 convolutions are dots of patches).
  p = _run('before_after', '--change', change, '--models', 'R50+ViT-B_16', '--batch', '2',
           '--dtypes', 'bfloat16', '--steps', '1', '--rounds', '1', *TINY, '--override',
           'resnet_layers=[1]', tmp_path=tmp_path)
  r = p['results'][0]
  assert len(r['ratio_per_round']) == 1 and min(r['ratio_per_round']) > 0
  if change == 'parameter_gradients_first':
    # Its GroupNorms' gradients keep their cotangents alive until the end of the backward
    # pass without the dependence.
    assert r['xla_memory_gib']['after'] < r['xla_memory_gib']['before'], r['xla_memory_gib']
  if change == 'max_pool_slices':  # the stem's pool: nn.max_pool before, slices after
    assert r['reduce_windows'] == {'before': 1, 'after': 0}, r['reduce_windows']


def test_before_after_conv_as_dot(tmp_path):
  # A bf16 hybrid with a root-only stem: its patch embedding becomes a dot, the 7x7 root
  # convolution (3 channels) stays a convolution.
  p = _run('before_after', '--change', 'conv_as_dot', '--models', 'R+ViT-Ti_16', '--batch', '2',
           '--dtypes', 'bfloat16', '--steps', '1', '--rounds', '1', '--image_size', '64',
           '--override', 'num_layers=1', tmp_path=tmp_path)
  convolutions = p['results'][0]['convolutions']
  assert convolutions['before'] > convolutions['after'] > 0, convolutions


def test_before_after_mixed_dots(tmp_path):
  # Before: flax's and XLA's bf16 dots, with bf16 results; after: precision.py's, f32 results.
  p = _run('before_after', '--change', 'mixed_dots', '--models', 'ViT-Ti_16', '--batch', '2',
           '--dtypes', 'bfloat16', '--steps', '1', '--rounds', '1', *TINY, tmp_path=tmp_path)
  dots = p['results'][0]['bf16_result_dots']
  assert dots['before'] > 0 and dots['after'] == 0, dots
  # Only the dots change: where the attention fuses (an NVIDIA GPU), on both sides.
  calls = p['results'][0]['fused_attention_calls']
  assert calls['before'] == calls['after'], calls
  assert (calls['after'] > 0) == attention.fuses(jnp.bfloat16, 24), calls


def _refusal(script, *flags):
  """The one line a benchmark that refuses its flags ends with (it must exit non-zero)."""
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, 'benchmarks', f'{script}.py'), *flags], cwd=REPO,
      capture_output=True, text=True, timeout=300, env={
          **os.environ, 'VIT_JAX_XLA_CPU_FLAGS': '1'
      })
  assert proc.returncode != 0, proc.stdout
  return proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize('script,flag,value,why', [
    ('train_step', 'batch', '0', '0 must be 1 or more'),
    ('vs_pytorch', 'batch', '8,x', "'x' is not a whole number"),
    ('before_after', 'steps', '0', '0 must be 1 or more'),
    ('loop', 'steps', '0', '0 must be 1 or more'),
    ('input_speed', 'rounds', '-1', '-1 must be 1 or more'),
    ('checkpoint_save', 'rounds', '0', '0 must be 1 or more'),
    ('block_breakdown', 'heads', '0', '0 must be 1 or more'),
    ('input_speed', 'jpeg_size', '375x500', "'375x500' is not height,width (e.g. 375,500)"),
    ('loop', 'jpeg_size', '375,0', '0 must be 1 or more'),
])
def test_a_count_below_one_is_refused_in_one_line(script, flag, value, why):
  """As a user types it: before, --batch 0 ran into a NaN loss and --steps 0 an IndexError."""
  line = _refusal(script, f'--{flag}', value)
  assert line == f'{script}.py: error: argument --{flag}: {why}'


@pytest.mark.parametrize(
    'flags,line',
    [
        (['--models', 'ViT-X_16'
         ], "train_step.py: ViT-X_16: Unknown model 'ViT-X_16' (did you mean "
         'ViT-S_16?); known: '),
        (['--image_size', '15'
         ], 'train_step.py: ViT-Ti_16: image_size 15 is not divisible by patch '
         'size 16: set --image_size to a multiple of 16'),
        (['--dtypes', 'bf16'
         ], "train_step.py: ViT-Ti_16: dtype 'bf16' is unknown: set --dtypes to one "
         'of '),
        (['--remat', 'bogus'
         ], "train_step.py: ViT-Ti_16: remat 'bogus' is unknown: set --remat to one "
         'of '),
        (['--override', 'num_layer=2'], 'train_step.py: ViT-Ti_16: Unknown field(s) num_layer for '
         'ViT-Ti_16 (vit family); fields: '),
        # These four had ended in tracebacks (a ValueError, JAX's IndivisibleError) or MFU 9.6e9%.
        (['--override', 'num_layers'
         ], "train_step.py: --override: Model override 'num_layers' is not "
         'name=value: e.g. num_layers=2'),
        (['--mesh', '3'
         ], 'train_step.py: ViT-Ti_16: --batch 2 does not split over --mesh 3 devices: '
         'give a multiple of --mesh'),
        (['--peak', '200'
         ], 'train_step.py: error: --peak 200 is not a peak in FLOP/s per device: set '
         '--peak to FLOP/s'),
        (['--peak', '-5'], 'train_step.py: error: --peak -5 is not a peak'),
    ])
def test_a_bad_model_flag_is_refused_in_one_line(flags, line):
  """A model, size, dtype or remat the step cannot build had ended in the model's traceback."""
  base = ['--models', 'ViT-Ti_16', '--batch', '2']
  assert _refusal('train_step', *with_flags(base, flags)).startswith(line)


def test_help_says_the_whole_first_paragraph_and_every_default(monkeypatch):
  """The description had been the docstring's first line, cut mid-sentence; flags without a
  help text had shown no default."""
  harness = _benchmark_module(monkeypatch, 'harness')
  parser = harness.argument_parser("""What one save costs: packed, as vit_jax saves,
  against every array saved as itself.

    python benchmarks/x.py
  """)
  parser.add_argument('--torch', default='compile')
  parser.add_argument('--rounds', type=int, default=6, help='rounds')
  parser.add_argument('--out', default='')
  parser.add_argument('--quiet', action='store_true')
  text = ' '.join(parser.format_help().split())
  assert ('What one save costs: packed, as vit_jax saves, against every array saved as itself. '
          'options:') in text
  assert '--torch TORCH default: compile' in text and '--rounds ROUNDS rounds (default: 6)' in text
  assert text.endswith('--out OUT --quiet')  # nothing to say for an empty or a False default


def test_loop_takes_the_flag_names_its_messages_give():
  """loop.py times one model and dtype; a shared message names --dtypes, which it had not
  taken ('unrecognized arguments')."""
  assert _refusal(
      'loop', '--dtypes',
      'bf16').startswith("loop.py: ViT-Ti_16: dtype 'bf16' is unknown: set --dtypes to one of ")
  assert _refusal('loop', '--models', 'ViT-Ti_16,ViT-S_16') == (
      'loop.py: --model ViT-Ti_16,ViT-S_16: one at a time here: run loop.py once per value')


@pytest.mark.parametrize('change', ['fused_attention', 'tokens_padded_once'])
def test_before_after_fused_attention(tmp_path, change):
  # Where it fuses: cuDNN's attention calls after (a forward and a backward per block), none
  # before the fused attention, as many before the tokens padded once. Elsewhere it is
  # refused in one line.
  flags = ('--change', change, '--models', 'ViT-Ti_16', '--batch', '2', '--dtypes', 'bfloat16',
           '--steps', '1', '--rounds', '1', *TINY)
  if attention.fuses(jnp.bfloat16, 64):
    calls = _run('before_after', *flags, tmp_path=tmp_path)['results'][0]['fused_attention_calls']
    before = 0 if change == 'fused_attention' else calls['after']
    assert calls['before'] == before and calls['after'] >= 1, calls
    return
  assert _refusal(
      'before_after',
      *flags) == (f'--change {change}: bfloat16 on cpu is not fused; pass --dtypes bfloat16 on an '
                  'NVIDIA GPU (Ampere or later)')


def test_before_after_no_command_buffers(tmp_path):
  # On an NVIDIA GPU both sides run (the same dots, the same attention); elsewhere it is
  # refused in one line, before anything compiles.
  flags = ('--change', 'no_command_buffers', '--models', 'ViT-Ti_16', '--batch', '2', '--dtypes',
           'float32', '--steps', '1', '--rounds', '1', *TINY)
  if accelerator.cuda_capability():
    r = _run('before_after', *flags, tmp_path=tmp_path)['results'][0]
    assert r['bf16_result_dots']['before'] == r['bf16_result_dots']['after'], r
    return
  assert _refusal('before_after', *flags) == (
      "--change no_command_buffers: XLA:GPU's command buffers need an NVIDIA GPU; the backend "
      'is cpu')


def test_allocator(tmp_path):
  # The C math library stands in for jemalloc (preloading it changes nothing): the smoke
  # test needs no jemalloc on the host.
  library = harmless_preload()
  p = _run('allocator', '--models', 'ViT-Ti_16', '--batch', '2', '--steps', '1', '--rounds', '1',
           '--library', library, '--without_wait', *TINY, tmp_path=tmp_path)
  assert p['environments']['jemalloc']['LD_PRELOAD'] == library
  assert p['environments']['malloc']['LD_PRELOAD'] == ''
  r = p['results'][0]
  assert set(r['over_malloc_per_round']) == {'jemalloc', 'jemalloc, no wait'}
  assert len(r['over_malloc_per_round']['jemalloc']) == 1
  assert r['runs']['malloc'][0]['peak_rss_gib'] > 0
  # Each side's train_step.py took the allocator its environment chose, not its own default.
  assert r['runs']['malloc'][0]['host_allocator'] == "host allocator: the C library's malloc"
  assert r['runs']['jemalloc'][0]['host_allocator'].startswith(f'host allocator: {library}, ')


def test_block_breakdown(tmp_path):
  p = _run('block_breakdown', '--batch', '2', '--tokens', '5', '--hidden', '16', '--mlp', '32',
           '--heads', '2', '--dtypes', 'float32', '--rounds', '1', '--reps', '1', '--step_hlo', '',
           tmp_path=tmp_path)
  assert {r['variant'] for r in p['results']
         } == {'vit_jax', 'attn_bhqd', 'fused_qkv', 'attn_only', 'attn_dpa', 'mlp_only'}
  assert p['attn_dpa_max_abs_diff_vs_attn_only_f32'] < 1e-4
  assert all(r['fwd_bwd_s_per_round'][0] > 0 for r in p['results'])
  # Every JSON names the host as benchmarks/README.md tells hosts apart (it had held the
  # hostname alone), and this one ran under vit-train's allocator choice.
  assert p['host']['cpu_model'] == cpu_features.model() and p['host']['cpu_cores'] >= 1
  assert p['args']['allocator'] == (os.environ.get('VIT_JAX_HOST_ALLOCATOR') or 'auto')


def test_no_script_reuses_a_package_module_name():
  package = {os.path.splitext(f)[0] for f in os.listdir(os.path.join(REPO, 'vit_jax'))}
  scripts = {
      os.path.splitext(f)[0] for f in os.listdir(os.path.join(REPO, 'benchmarks'))
      if f.endswith('.py')
  }
  assert not scripts & package


def test_device_time(tmp_path):
  # The vit_jax side on the CPU: every traced thunk is charged to an HLO instruction's kind.
  # It runs under the allocator vit-train would preload, which keys the probe's verdict.
  library = harmless_preload()  # stands in for jemalloc, as in test_allocator
  p = _run('device_time', '--models', 'ViT-Ti_16', '--batch', '2', '--dtypes', 'float32', '--steps',
           '2', '--warmup', '1', '--torch', 'none', '--allocator', library, *TINY,
           tmp_path=tmp_path)
  side = p['results'][0]['vit_jax']
  assert side['host_allocator'].startswith(f'host allocator: {library}, preloaded at start-up')
  assert side['ms_per_step']['matmul'] > 0 and side['ms_per_step']['elementwise fusion'] > 0
  assert sum(side['ms_per_step'].values()) < side['wall_ms_per_step']
  assert side['gpu_memory'] == '' and len(side['top']) == 12 and side['concurrency'] > 0.999
  # Its dots by shape: the attention core's batched ones among them (a chunk of one image's 2
  # heads, TINY's 5 tokens of head size 24), every one of them timed.
  labels = [d['dots'] for d in side['dots']]
  assert any(label.startswith('2 x 5x24x5') for label in labels), labels
  assert all(d['gflops_per_s'] > 0 and d['per_step'] >= 1 for d in side['dots'])


def test_device_time_beside_pytorch_on_the_cpu(tmp_path):
  # PyTorch's operators on the CPU, classed by their aten:: names beside vit_jax's thunks.
  pytest.importorskip('torch')
  library = harmless_preload()
  p = _run('device_time', '--models', 'ViT-Ti_16', '--batch', '2', '--dtypes', 'float32', '--steps',
           '1', '--warmup', '1', '--torch', 'eager', '--allocator', library, *TINY,
           tmp_path=tmp_path)
  side = p['results'][0]['torch']
  assert side['ld_preload'] == ''  # PyTorch runs as its users run it, vit_jax's preload left out
  assert side['device'].startswith('CPU') and 'eager' in side['impl']
  for kind in ('matmul', 'attention', 'convolution', 'reduction fusion', 'elementwise fusion'):
    assert side['ms_per_step'][kind] > 0, kind
  assert sum(side['ms_per_step'].values()) < side['wall_ms_per_step']
  # The speed ratio from the traced walls, and its bound with the matmuls as they ran.
  (first, traced), *_, (last, bound) = p['results'][0]['ratios_if']
  assert first == 'as traced' and last == 'every kind but matmul at the shorter time'
  assert traced == pytest.approx(side['wall_ms_per_step']
                                 / p['results'][0]['vit_jax']['wall_ms_per_step'])
  assert bound >= traced


@pytest.mark.parametrize('script, flags', [('device_time', ['--torch', 'none']), ('vs_pytorch', []),
                                           ('train_step', []), ('before_after', [])])
def test_a_bad_allocator_is_refused_in_one_line(script, flags):
  proc = subprocess.run([
      sys.executable,
      os.path.join(REPO, 'benchmarks', f'{script}.py'), '--allocator', 'jemaloc', *flags
  ], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1] == (
      '--allocator: VIT_JAX_HOST_ALLOCATOR=jemaloc: no such file; set it to auto, jemalloc, '
      'system, or the path of a libjemalloc.so.2')


def _benchmark_module(monkeypatch, name):
  """benchmarks/<name>.py imported as a module, its flags at their defaults."""
  monkeypatch.setattr(sys, 'argv', [f'{name}.py'])
  monkeypatch.syspath_prepend(os.path.join(REPO, 'benchmarks'))
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, 'benchmarks',
                                                                   f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# The shape of XLA:GPU's optimised HLO (H100, jax 0.11.2): an elementwise fusion whose
# operands are Triton gemms is no matmul itself.
GPU_HLO = '\n'.join([
    'HloModule jit_step, entry_computation_layout={()->f32[8]{0}}',
    '',
    '%add (a: f32[], b: f32[]) -> f32[] {',
    '  %a = f32[] parameter(0)',
    '  %b = f32[] parameter(1)',
    '  ROOT %add.1 = f32[] add(%a, %b)',
    '}',
    '',
    '%fused_multiply.12 (param_0.1: f32[4,8], param_1.2: f32[4,8]) -> f32[4,8] {',
    '  %param_0.1 = f32[4,8]{1,0} parameter(0)',
    '  %param_1.2 = f32[4,8]{1,0} parameter(1)',
    '  ROOT %multiply.3 = f32[4,8]{1,0} multiply(%param_0.1, %param_1.2)',
    '}',
    '',
    '%gemm_fusion_dot.5_computation (parameter_0: bf16[4,16], parameter_1: bf16[16,8]) -> f32[4,8] {',
    '  %parameter_0 = bf16[4,16]{1,0} parameter(0)',
    '  %parameter_1 = bf16[16,8]{1,0} parameter(1)',
    '  ROOT %dot.1 = f32[4,8]{1,0} dot(%parameter_0, %parameter_1)'
    ', lhs_contracting_dims={1}, rhs_contracting_dims={0}',
    '}',
    '',
    '%fused_reduce (param_0.3: f32[4,8]) -> f32[8] {',
    '  %param_0.3 = f32[4,8]{1,0} parameter(0)',
    '  %constant.1 = f32[] constant(0)',
    '  ROOT %reduce.2 = f32[8]{0} reduce(%param_0.3, %constant.1), dimensions={0}, to_apply=%add',
    '}',
    '',
    'ENTRY %main.10 (p0: bf16[4,16], p1: bf16[16,8]) -> f32[8] {',
    '  %p0 = bf16[4,16]{1,0} parameter(0)',
    '  %p1 = bf16[16,8]{1,0} parameter(1)',
    '  %gemm_fusion_dot.5 = f32[4,8]{1,0} fusion(%p0, %p1), kind=kCustom'
    ', calls=%gemm_fusion_dot.5_computation'
    ', backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}',
    '  %custom-call.3 = (f32[4,8]{1,0}, s8[1024]{0}) custom-call(%p0, %p1)'
    ', custom_call_target="__cublas$lt$matmul"',
    '  %get-tuple-element.1 = f32[4,8]{1,0} get-tuple-element(%custom-call.3), index=0',
    '  %custom-call.4 = (bf16[4,16]{1,0}, u8[0]{0}) custom-call(%p0, %p0, %p0)'
    ', custom_call_target="__cudnn$fmhaSoftmax"',
    '  %loop_multiply_fusion.12 = f32[4,8]{1,0} fusion(%gemm_fusion_dot.5'
    ', %get-tuple-element.1), kind=kLoop, calls=%fused_multiply.12',
    '  %copy.1 = f32[4,8]{0,1} copy(%loop_multiply_fusion.12)',
    '  ROOT %input_reduce_fusion = f32[8]{0} fusion(%copy.1), kind=kInput, calls=%fused_reduce',
    '}',
    '',
])


def test_device_time_kinds(monkeypatch):
  device_time = _benchmark_module(monkeypatch, 'device_time')
  kinds = device_time.hlo_kinds(GPU_HLO)
  assert {
      op: kinds[op] for op in ('gemm_fusion_dot.5', 'custom-call.3', 'custom-call.4',
                              'loop_multiply_fusion.12', 'copy.1', 'input_reduce_fusion')
  } == {
      'gemm_fusion_dot.5': 'matmul',
      'custom-call.3': 'matmul',
      'custom-call.4': 'attention',
      'loop_multiply_fusion.12': 'elementwise fusion',
      'copy.1': 'copy/layout',
      'input_reduce_fusion': 'reduction fusion'
  }
  # XLA:CPU: a YNNPACK fusion of a batched dot is the attention core; of a plain dot, a matmul.
  cpu_hlo = '\n'.join([
      'HloModule jit_step', '',
      '%ynn_fused_computation (p0: f32[2,3,4], p1: f32[2,4,5]) -> f32[2,3,5] {',
      '  %p0 = f32[2,3,4]{2,1,0} parameter(0)', '  %p1 = f32[2,4,5]{2,1,0} parameter(1)',
      '  ROOT %dot.2 = f32[2,3,5]{2,1,0} dot(%p0, %p1), lhs_batch_dims={0}, '
      'lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}', '}', '',
      'ENTRY %main (a: f32[2,3,4], b: f32[2,4,5], c: f32[3,4], d: f32[4,5]) -> f32[3,5] {',
      '  %a = f32[2,3,4]{2,1,0} parameter(0)', '  %b = f32[2,4,5]{2,1,0} parameter(1)',
      '  %c = f32[3,4]{1,0} parameter(2)', '  %d = f32[4,5]{1,0} parameter(3)',
      '  %ynn_fusion.7 = f32[2,3,5]{2,1,0} fusion(%a, %b), kind=kCustom, '
      'calls=%ynn_fused_computation',
      '  ROOT %dot.3 = f32[3,5]{1,0} dot(%c, %d), lhs_contracting_dims={1}, '
      'rhs_contracting_dims={0}', '}', ''
  ])
  assert {
      op: device_time.hlo_kinds(cpu_hlo)[op] for op in ('ynn_fusion.7', 'dot.3')
  } == {
      'ynn_fusion.7': 'attention',
      'dot.3': 'matmul'
  }
  # PyTorch's CUDA kernels, as torch.profiler named them on an H100 (timm, torch.compile).
  names = {
      'nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN': 'matmul',
      'cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64': 'attention',
      'void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*)': 'attention',
      'void cutlass__5x_cudnn::Kernel<cutlass_tensorop_bf16_s16816fprop_optimized_bf16>': 'convolution',
      'triton_per_fused__to_copy_add_native_layer_norm_backward_view_11': 'reduction fusion',
      'triton_poi_fused_gelu_view_9': 'elementwise fusion',
      'void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16>': 'copy/layout',
  }
  assert {n: device_time.kernel_kind(n) for n in names} == names
  # PyTorch's CPU operators (torch 2.13, the minimal ViT's step): an autograd node's own
  # entry is bookkeeping, whatever operator its name holds.
  operators = {
      'aten::addmm': 'matmul',
      'aten::mm': 'matmul',
      'aten::_scaled_dot_product_flash_attention_for_cpu_backward': 'attention',
      'aten::mkldnn_convolution': 'convolution',
      'aten::convolution_backward': 'convolution',
      'aten::native_layer_norm_backward': 'reduction fusion',
      'aten::sum': 'reduction fusion',
      'aten::linalg_vector_norm': 'reduction fusion',
      'aten::gelu_backward': 'elementwise fusion',
      'aten::add_': 'elementwise fusion',
      'aten::_foreach_mul_': 'elementwise fusion',
      'aten::copy_': 'copy/layout',
      'aten::cat': 'copy/layout',
      'aten::t': 'copy/layout',
      'AddmmBackward0': 'other',
      'autograd::engine::evaluate_function: AddmmBackward0': 'other',
      'torch::autograd::AccumulateGrad': 'other',
      'Optimizer.step#SGD.step': 'other',
  }
  assert {n: device_time.aten_kind(n) for n in operators} == operators


def test_device_time_dots(monkeypatch):
  # Each dot as (batch, M, K, N), read from the compiled program's HLO: a plain dot, its two
  # gradients (a transposed operand each) and a batched dot all have their FLOPs.
  device_time = _benchmark_module(monkeypatch, 'device_time')

  def loss(x, w, q, k):
    return (x @ w).sum() + jnp.einsum('bqd,bkd->bqk', q, k).sum()

  shapes = [(64, 32), (32, 48), (4, 16, 8), (4, 24, 8)]
  args = [jnp.ones(s, jnp.float32) for s in shapes]
  forward = device_time.hlo_dots(jax.jit(loss).lower(*args).compile().as_text())
  assert sorted(d for dots in forward.values() for d in dots) == [(1, 64, 32, 48), (4, 16, 8, 24)]
  gradients = jax.jit(jax.grad(lambda x, w: (x @ w * x[:, :1]).sum(), argnums=(0, 1)))
  dots = device_time.hlo_dots(gradients.lower(*args[:2]).compile().as_text())
  flops = sorted(2 * math.prod(d) for dots in dots.values() for d in dots)
  assert flops == [2 * 64 * 32 * 48] * 3  # forward, input gradient, weight gradient
  # XLA:GPU: a Triton gemm fusion and a cuBLAS call with its dimension numbers; a call
  # without them is left out rather than guessed.
  cublas = ('  %custom-call.9 = (f32[4,8]{1,0}, s8[1024]{0}) custom-call(%p0, %p1), '
            'custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":'
            '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
            '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],'
            '"rhs_batch_dimensions":[]}}}')
  gpu = device_time.hlo_dots(GPU_HLO.replace('  %custom-call.4', cublas + '\n  %custom-call.4'))
  assert gpu == {'gemm_fusion_dot.5': [(1, 4, 16, 8)], 'custom-call.9': [(1, 4, 16, 8)]}
  assert device_time.dot_label([(24, 197, 64, 197),
                                (1, 6304, 192, 768)]) == '24 x 197x64x197 + 6304x192x768'
  # PyTorch's CPU matmul operators, by torch.profiler's input shapes (addmm: bias first).
  assert device_time.torch_dot('aten::addmm', [[16], [10, 32], [32, 16], [], []]) == (1, 10, 32, 16)
  assert device_time.torch_dot('aten::mm', [[16, 10], [10, 32]]) == (1, 16, 10, 32)
  assert device_time.torch_dot('aten::bmm', [[6, 5, 8], [6, 8, 5]]) == (6, 5, 8, 5)
  assert device_time.torch_dot('aten::add', [[6, 5], [6, 5]]) is None
  # One row per shape: the count, FLOPs and time per step, the rate of the time each ran.
  table = device_time.dot_table([('a', 4e9, 10.0, 20.0), ('a', 4e9, 10.0, 20.0),
                                 ('b', 1e9, 30.0, 30.0)], steps=2)
  assert table == [
      dict(dots='b', per_step=0.5, gflop_per_step=0.5, ms_per_step=15.0, running_ms_per_step=15.0,
           gflops_per_s_charged=pytest.approx(1e9 / 1e6 / 30.0),
           gflops_per_s=pytest.approx(1e9 / 1e6 / 30.0)),
      dict(dots='a', per_step=1.0, gflop_per_step=4.0, ms_per_step=10.0, running_ms_per_step=20.0,
           gflops_per_s_charged=pytest.approx(8e9 / 1e6 / 20.0),
           gflops_per_s=pytest.approx(8e9 / 1e6 / 40.0)),
  ]


def test_device_time_ratios_if(monkeypatch):
  # vit_jax 100 ms (matmul 60, attention 30, elementwise 6) against PyTorch's 90 (matmul 52,
  # attention 20, elementwise 10): vit_jax is slower in matmul and attention; the bound keeps
  # its matmuls and cuts only the attention (its faster elementwise work stays).
  device_time = _benchmark_module(monkeypatch, 'device_time')
  kinds = ('matmul', 'attention', 'elementwise fusion')
  mine = dict(wall_ms_per_step=100.0, ms_per_step=dict(zip(kinds, (60.0, 30.0, 6.0))))
  theirs = dict(wall_ms_per_step=90.0, ms_per_step=dict(zip(kinds, (52.0, 20.0, 10.0))))
  rows = device_time.ratios_if(mine, theirs)
  assert [w for w, _ in rows] == [
      'as traced', "matmul at PyTorch's time", "attention at PyTorch's time",
      'every kind but matmul at the shorter time'
  ]
  assert [r for _, r in rows] == pytest.approx([0.9, 90 / 92, 1.0, 1.0])
  theirs['ms_per_step']['copy/layout'] = 5.0  # only PyTorch's: no row, nothing to cut
  mine['ms_per_step']['convolution'] = 12.0
  rows = dict(device_time.ratios_if(mine, theirs))
  assert "copy/layout at PyTorch's time" not in rows
  assert rows["convolution at PyTorch's time"] == pytest.approx(90 / 88)
  assert rows['every kind but matmul at the shorter time'] == pytest.approx(90 / 78)


def test_device_time_wall_shares(monkeypatch):
  # Two thunks at once share the time both ran; alone, a thunk has all of its time.
  device_time = _benchmark_module(monkeypatch, 'device_time')
  assert device_time.wall_shares([(0, 10), (5, 15), (20, 22)]) == [7.5, 7.5, 2.0]
  assert device_time.wall_shares([(0, 10), (0, 10), (0, 10)]) == pytest.approx([10 / 3] * 3)


def test_train_step_times_the_peak_again_where_mfu_exceeds_one(monkeypatch, capsys):
  """A step timed at 2 GFLOP/s against a peak timed at 1 reads MFU 200%: the peak is timed
  again (here it comes back at 4, then MFU is 50%); one that stays slow is timed again
  CPU_PEAK_RETIMES times, then warned about."""
  train_step = _benchmark_module(monkeypatch, 'train_step')

  class Step:
    flops_analytic = 2e9
    config = type('Config', (), {'dtype': 'float32'})
    mesh = type('Mesh', (), {'devices': np.zeros((1,))})

  timings = iter([4e9])
  monkeypatch.setattr(train_step.device_peaks, 'better_cpu_peak',
                      lambda dtype, earlier: max(earlier, next(timings)))
  retimes = train_step._retime_where_mfu_exceeds_one([Step()], [[1.0, 1.5]],
                                                     {'float32': [1e9, 1e9]},
                                                     {'float32': 'measured'})
  assert retimes == {'float32': [4e9]} and 'warning' not in capsys.readouterr().out
  timings = iter([1.1e9] * 10)
  retimes = train_step._retime_where_mfu_exceeds_one([Step()], [[1.0]], {'float32': [1e9]},
                                                     {'float32': 'measured'})
  assert len(retimes['float32']) == train_step.device_peaks.CPU_PEAK_RETIMES
  assert 'warning: float32 MFU reads over 100% after 5 more timings' in capsys.readouterr().out
  # A given peak is not timed.
  assert train_step._retime_where_mfu_exceeds_one([Step()], [[1.0]], {'float32': [1e9]},
                                                  {'float32': 'given'}) == {
                                                      'float32': []
                                                  }


def test_block_breakdown_names_an_unknown_dtype():
  """It had ended in KeyError: 'bf16'."""
  assert _refusal(
      'block_breakdown', '--dtypes',
      'bf16') == ("block_breakdown.py: error: --dtypes: 'bf16' is unknown: use float32,bfloat16")
