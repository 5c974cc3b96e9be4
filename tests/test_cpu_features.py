"""The bf16 warning for CPUs without bf16 arithmetic, from /proc/cpuinfo files of each kind,
and as vit-train prints it."""
import os
import subprocess
import sys

import pytest

from vit_jax import cpu_features

X86_BF16 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile

processor\t: 1
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile
"""
X86_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
cpu family\t: 25
flags\t\t: fpu sse2 avx avx2 fma bmi2
"""
ARM_BF16 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd sve bf16 i8mm
"""
ARM_NO_BF16 = """processor\t: 0
Features\t: fp asimd evtstrm crc32
"""


def _cpuinfo(tmp_path, text):
  path = tmp_path / 'cpuinfo'
  path.write_text(text)
  return str(path)


@pytest.mark.parametrize('text', [X86_BF16, ARM_BF16])
def test_no_note_where_the_cpu_has_bf16(tmp_path, text):
  assert cpu_features.bf16_note('bfloat16', _cpuinfo(tmp_path, text)) == ''


@pytest.mark.parametrize('text', [X86_AVX2, ARM_NO_BF16])
def test_note_where_the_cpu_lacks_bf16(tmp_path, text):
  note = cpu_features.bf16_note('bfloat16', _cpuinfo(tmp_path, text))
  assert note.startswith('dtype bfloat16 on a CPU without bf16 instructions')
  assert note.endswith('compare --config.dtype=float32') and '\n' not in note


def test_float32_and_unreadable_cpuinfo_give_no_note(tmp_path):
  assert cpu_features.bf16_note('float32', _cpuinfo(tmp_path, X86_AVX2)) == ''
  assert cpu_features.bf16_note('bfloat16', str(tmp_path / 'missing')) == ''
  assert cpu_features.bf16_note('bfloat16', _cpuinfo(tmp_path, 'processor\t: 0\n')) == ''


def test_fields_keep_the_first_value(tmp_path):
  info = cpu_features.fields(_cpuinfo(tmp_path, X86_AVX2 + 'cpu family\t: 23\n'))
  assert info['model name'] == 'AMD EPYC' and info['cpu family'] == '25'
  listed = cpu_features.features(_cpuinfo(tmp_path, X86_AVX2))
  assert listed == {'fpu', 'sse2', 'avx', 'avx2', 'fma', 'bmi2'}


def test_vit_train_warns_once_on_a_cpu_without_bf16(tmp_path):
  """The CLI from the shell with dtype=bfloat16, this process seeing an AVX2-only CPU."""
  fake = _cpuinfo(tmp_path, X86_AVX2)
  script = ('import runpy, sys\n'
            'from vit_jax import cpu_features\n'
            f'cpu_features.CPUINFO = {fake!r}\n'
            'sys.argv[0] = "vit-train"\n'
            'runpy.run_module("vit_jax.main", run_name="__main__")\n')
  args = [
      '--config=quickstart', '--config.dtype=bfloat16', '--config.total_steps=2',
      '--config.warmup_steps=1', '--config.eval_every_steps=0', '--config.log_every_steps=1',
      '--config.checkpoint_every_steps=0', '--config.train_split=train[:256]',
      '--config.eval_split=test[:64]', '--config.model.num_layers=1', '--config.batch_size=32',
      '--config.eval_batch_size=64', '--workdir=run'
  ]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  env.pop('XLA_FLAGS', None)
  proc = subprocess.run([sys.executable, '-c', script, *args], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  warnings = [l for l in proc.stderr.splitlines() if 'without bf16 instructions' in l]
  assert len(warnings) == 1 and warnings[0].startswith('W'), proc.stderr[-3000:]
  assert 'Final test[:64] top-1 accuracy' in proc.stderr.strip().splitlines()[-1]
