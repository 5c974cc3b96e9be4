"""Tests for vit_jax/chrono.py, vit_jax/device_peaks.py, vit_jax/trace.py and flops.step_flops:
every figure against hand arithmetic, with a fake clock."""
import glob
import logging
import os

import jax
import jax.numpy as jnp
import pytest

from configs import common
from vit_jax import chrono as chrono_lib
from vit_jax import device_peaks, flops, trace


class FakeClock:
  """A clock the test moves by hand."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def _chrono(clock, **overrides):
  kw = dict(total_steps=100, global_batch=32, num_train_examples=1600, num_devices=8,
            flops_per_step=4e12, peak_flops_per_device=1e12, clock=clock)
  kw.update(overrides)
  return chrono_lib.Chrono(**kw)


def test_speed_leaves_out_compilation_and_pauses():
  clock = FakeClock()
  chrono = _chrono(clock)
  clock.now = 10.0  # step 1 (with compilation) took 10 s
  chrono.first_step_done(1, compile_seconds=10.0)
  clock.now = 15.0
  with chrono.paused():  # an evaluation of 3 s
    clock.now = 18.0
  clock.now = 20.0
  got = chrono.report(11)
  # 10 steps in 20 - 10 - 3 = 7 s of training.
  assert got['steps_per_sec'] == pytest.approx(10 / 7)
  assert got['img_per_sec_per_core'] == pytest.approx(10 * 32 / 7 / 8)
  assert got['mfu'] == pytest.approx(10 * 4e12 / 7 / (1e12 * 8))
  # ETA: 10 s (pause included) for 10 steps, 89 steps to go.
  assert got['eta_seconds'] == pytest.approx(89.0)
  assert got['progress'] == pytest.approx(0.11)
  assert got['examples_seen'] == 11 * 32
  assert got['epoch'] == pytest.approx(11 * 32 / 1600)
  assert got['core_hours'] == pytest.approx(8 * 20 / 3600)  # pauses and compilation count
  assert got['compile_seconds'] == 10.0

  clock.now = 30.0
  got = chrono.report(21)  # the next interval: 10 steps in 10 s, no pause
  assert got['steps_per_sec'] == pytest.approx(1.0)
  assert got['img_per_sec_per_core'] == pytest.approx(32 / 8)
  assert got['mfu'] == pytest.approx(4e12 / 8e12)
  assert got['eta_seconds'] == pytest.approx(20 / 20 * 79)
  assert 'compile_seconds' not in got  # reported once


def test_resumed_run_counts_all_steps_and_times_its_own():
  clock = FakeClock()
  chrono = _chrono(clock, total_steps=1000, core_hours_before=2.5)  # saved with step 500
  clock.now = 30.0
  chrono.first_step_done(501, compile_seconds=30.0)  # resumed after step 500
  clock.now = 50.0
  got = chrono.report(541)
  assert got['examples_seen'] == 541 * 32  # the earlier run's steps included
  assert got['progress'] == pytest.approx(0.541)
  assert got['epoch'] == pytest.approx(541 * 32 / 1600)
  assert got['steps_per_sec'] == pytest.approx(40 / 20)
  assert got['eta_seconds'] == pytest.approx(20 / 40 * 459)
  assert got['core_hours'] == pytest.approx(2.5 + 8 * 50 / 3600)  # the earlier ones too
  assert chrono.core_hours() == pytest.approx(2.5 + 8 * 50 / 3600)  # (as saved)


def test_pauses_before_timing_and_nested_pauses():
  clock = FakeClock()
  chrono = _chrono(clock)
  with chrono.paused():  # before the first step is done: not subtracted later
    clock.now = 4.0
  clock.now = 10.0
  chrono.first_step_done(1, compile_seconds=10.0)
  with chrono.paused():
    clock.now = 12.0
    with chrono.paused():  # nested: the outer pause already counts this time
      clock.now = 13.0
    clock.now = 14.0
  clock.now = 20.0
  assert chrono.report(7)['steps_per_sec'] == pytest.approx(6 / (10 - 4))


def test_traced_steps_are_left_out_of_the_speed():
  clock = FakeClock()
  chrono = _chrono(clock)
  clock.now = 10.0
  chrono.first_step_done(1, compile_seconds=10.0)
  clock.now = 14.0  # steps 2-5: 4 steps in 4 s
  chrono.untimed_from(6)
  clock.now = 30.0  # steps 6-7 under the profiler: 16 s
  chrono.untimed_through(7)
  clock.now = 33.0  # steps 8-10: 3 steps in 3 s
  got = chrono.report(10)
  assert got['steps_per_sec'] == pytest.approx(1.0)  # 7 steps in 7 s, not 9 in 23
  assert got['eta_seconds'] == pytest.approx(23 / 9 * 90)  # the ETA keeps the trace's time

  # A log step inside the window: the interval up to it leaves out its traced steps, the next
  # interval the rest of them.
  clock.now = 35.0  # step 11 in 2 s
  chrono.untimed_from(12)
  clock.now = 40.0
  got = chrono.report(13)  # steps 12-13 traced
  assert got['steps_per_sec'] == pytest.approx(1 / 2)
  clock.now = 50.0
  chrono.untimed_through(14)
  clock.now = 52.0
  assert chrono.report(15)['steps_per_sec'] == pytest.approx(1 / 2)  # step 15 in 2 s
  chrono.untimed_from(16)
  clock.now = 60.0
  got = chrono.report(20)  # every step of the interval traced: no speed
  assert 'steps_per_sec' not in got and 'mfu' not in got and 'eta_seconds' in got
  chrono.untimed_through(20)

  # A trace of the first steps, the compiling one included: timing starts after it.
  clock = FakeClock()
  chrono = _chrono(clock)
  chrono.untimed_from(1)
  clock.now = 10.0
  chrono.first_step_done(1, compile_seconds=10.0)
  clock.now = 20.0
  chrono.untimed_through(3)  # steps 2-3 in 10 s
  clock.now = 22.0
  assert chrono.report(5)['steps_per_sec'] == pytest.approx(1.0)  # steps 4-5 in 2 s


def test_report_without_speed_peak_or_dataset_size():
  clock = FakeClock()
  chrono = _chrono(clock, num_train_examples=-1, peak_flops_per_device=None)
  clock.now = 1.0
  assert set(chrono.report(0)) == {'progress', 'examples_seen', 'core_hours'}  # not timed yet
  chrono.first_step_done(1, compile_seconds=1.0)
  clock.now = 3.0
  got = chrono.report(3)
  assert 'mfu' not in got and 'epoch' not in got
  assert got['img_per_sec_per_core'] == pytest.approx(2 * 32 / 2 / 8)
  assert 'steps_per_sec' not in chrono.report(3)  # no step since the last report
  with pytest.raises(ValueError, match='global_batch'):
    _chrono(clock, global_batch=0)


def test_log_text():
  clock = FakeClock()
  chrono = _chrono(clock, total_steps=1000, num_train_examples=3200)
  chrono.first_step_done(1, compile_seconds=0.0)
  clock.now = 10.0
  text = chrono.log_text(chrono.report(31))  # 30 steps in 10 s, 969 to go
  assert text == '12.0 img/s/core  MFU 150.0%  epoch 0.31  3.1%  ETA 0:05:23'
  assert chrono_lib.hms(3 * 3600 + 62) == '3:01:02'


def test_setup_text():
  assert (chrono_lib.setup_text(141_066, 1.532e9, 2.35e10, 'measured') ==
          '141,066 parameters; 1.53 GFLOP per step; peak 23.5 GFLOP/s per device (measured)')
  assert (chrono_lib.setup_text(86_000_000, 4.31e17, 989.5e12, 'table:NVIDIA H100 80GB HBM3') ==
          '86,000,000 parameters; 431 PFLOP per step; peak 990 TFLOP/s per device '
          '(table:NVIDIA H100 80GB HBM3)')
  assert chrono_lib.setup_text(1, 999.6e6, 5e18, 'given').startswith('1 parameters; 1 GFLOP')
  text = chrono_lib.setup_text(10, 1e9, None, 'unknown:NVIDIA GeForce RTX 4090')
  assert 'no peak FLOP/s known for unknown:NVIDIA GeForce RTX 4090' in text


@pytest.mark.parametrize(
    'kind,dtype,tflops',
    [
        ('TPU v2', 'bfloat16', 22.5),  # per TensorCore: two JAX devices per chip
        ('TPU v3', 'bfloat16', 61.5),
        ('TPU v3', 'float32', 61.5),  # one bf16 MXU pass, JAX's default precision
        ('TPU v4', 'bfloat16', 275),
        ('TPU v5 lite', 'bfloat16', 197),
        ('TPU v5', 'bfloat16', 459),
        ('TPU v5p', 'float32', 459),
        ('TPU v6 lite', 'bfloat16', 918),
        ('NVIDIA A100-SXM4-40GB', 'bfloat16', 312),
        ('NVIDIA A100 80GB PCIe', 'float32', 156),  # TF32
        ('NVIDIA H100 80GB HBM3', 'bfloat16', 989.5),
        ('NVIDIA H100 80GB HBM3', 'float32', 494.5),
        ('NVIDIA H100 PCIe', 'bfloat16', 756.5),
        ('NVIDIA H100 NVL', 'bfloat16', 835.5),
        ('NVIDIA H200', 'bfloat16', 989.5),
        ('NVIDIA H200 NVL', 'float32', 417.5),
    ])
def test_peak_table(kind, dtype, tflops):
  assert device_peaks.peak_flops(kind, dtype) == pytest.approx(tflops * 1e12)


def test_peak_table_misses_and_bad_dtype():
  for kind in ('cpu', 'TPU v4 lite', 'NVIDIA GeForce RTX 4090', 'Tesla V100-SXM2-16GB'):
    assert device_peaks.peak_flops(kind, 'bfloat16') is None
  with pytest.raises(ValueError, match='bfloat16, float32'):
    device_peaks.peak_flops('TPU v4', 'float16')


def test_resolve_peak_on_cpu():
  assert device_peaks.resolve_peak('float32', given=5e12) == (5e12, 'given')
  per_device, source = device_peaks.resolve_peak('float32')
  assert source == 'measured'
  whole = device_peaks.measure_cpu_peak('float32')  # cached: the same measurement
  assert per_device == pytest.approx(whole / jax.local_device_count())
  # Plausible: above 1 GFLOP/s, below 256 FLOP per cycle per core at 5 GHz.
  for dtype in ('float32', 'bfloat16'):
    assert 1e9 < device_peaks.measure_cpu_peak(dtype) < os.cpu_count() * 5e9 * 256


def test_the_cpu_peak_timed_again_keeps_the_better_per_device(monkeypatch):
  rates = iter([3e11, 1e11])
  monkeypatch.setattr(device_peaks.measure_cpu_peak, '__wrapped__', lambda dtype: next(rates))
  n = jax.local_device_count()
  assert device_peaks.better_cpu_peak('float32', 2e11 / n) == pytest.approx(3e11 / n)
  assert device_peaks.better_cpu_peak('float32', 2e11 / n) == pytest.approx(2e11 / n)


@pytest.mark.parametrize('given', [0.0, 1e9, 2.75e14])
def test_a_given_peak_in_flops_is_taken(given):
  device_peaks.validate_given(given)


@pytest.mark.parametrize('given', [-1.0, 275.0, 9.99e8, float('nan'), float('inf')])
def test_a_given_peak_that_cannot_be_flops_is_refused(given):
  # Negative, not a number, or a unit slip: 275 meant as TFLOP/s.
  with pytest.raises(
      ValueError, match=r'is not a peak in FLOP/s per device: set '
      r'--config.peak_flops_per_device to FLOP/s \(e.g. 2.75e14'):
    device_peaks.validate_given(given)


def test_step_flops_of_a_config():
  config = common.get_config()
  config.model_name, config.batch_size, config.image_size = 'ViT-Ti_16', 8, 32
  config.model.update(num_layers=1, hidden_size=8, mlp_dim=16, num_heads=2)
  # 5 tokens, D 8, MLP 16, 10 classes: embedding 2*4*768*8 = 49,152; layer 2*5*8*8*4 +
  # 2*2*5*5*8 + 2*2*5*8*16 = 5,920; head 2*8*10 = 160. x3 for training, x8 images.
  assert flops.step_flops(config, 10) == 8 * 3 * (49_152 + 5_920 + 160)
  # Masked patch prediction: no head; every one of the 4 patch tokens to 512 colours
  # (2*8*512 each) in its place.
  config.objective = 'masked_patches'
  assert flops.step_flops(config, 10) == 8 * 3 * (49_152 + 5_920 + 4 * 2 * 8 * 512)
  config.masked_patches.target = 'pixels'  # 16*16*3 values per patch
  assert flops.step_flops(config, 10) == 8 * 3 * (49_152 + 5_920 + 4 * 2 * 8 * 768)


def _traces(logdir):
  return glob.glob(os.path.join(logdir, 'plugins', 'profile', '*', '*.xplane.pb'))


def test_trace_of_chosen_steps(tmp_path, caplog):
  caplog.set_level(logging.INFO)
  step_fn = jax.jit(lambda x: x @ x)
  x = jnp.ones((32, 32))
  window = trace.StepTrace(str(tmp_path / 'window'), first_step=2, num_steps=2)
  active, started, stopped = [], [], []
  y = None
  for step in range(1, 6):
    started.append(window.before(step, pending=y))
    active.append(window.active)
    y = step_fn(x)
    stopped.append(window.after(step, y))
  window.close()
  assert active == [False, True, True, False, False]
  assert started == [False, True, False, False, False]  # what the loop leaves out of its speed
  assert stopped == [False, False, True, False, False]
  assert len(_traces(str(tmp_path / 'window'))) == 1
  said = lambda: [r.getMessage() for r in caplog.records if 'Profiler trace' in r.getMessage()]
  assert said() == [
      f'Profiler trace of steps 2-3 in {tmp_path / "window"}: view it with '
      f'`xprof --logdir={tmp_path / "window"}` or in TensorBoard\'s Profile tab '
      '(`pip install xprof`)'
  ]
  caplog.clear()

  # The run ends inside the window: close() stops and writes the trace.
  cut = trace.StepTrace(str(tmp_path / 'cut'), first_step=3, num_steps=10)
  for step in range(1, 5):
    cut.before(step)
    cut.after(step, step_fn(x))
  assert cut.active
  cut.close()
  assert not cut.active and len(_traces(str(tmp_path / 'cut'))) == 1
  assert said()[0].startswith('Profiler trace of steps 3-4 in ')  # the steps it ran

  # A run resumed after the window: nothing traced, one warning; inside it: the rest.
  caplog.clear()
  late = trace.StepTrace(str(tmp_path / 'late'), first_step=2, num_steps=2, resumed_at=3)
  assert late.done and [r.getMessage() for r in caplog.records] == [
      'No profiler trace in this run: its window, steps 2-3, lies before step 4, where the run '
      'resumes; set --config.profile_first_step to 4 or later to trace again'
  ]
  assert not trace.StepTrace(str(tmp_path / 'inside'), 2, 2, resumed_at=2).done
  caplog.clear()
  assert trace.StepTrace(str(tmp_path / 'finished'), 2, 2, resumed_at=10, last_step=10).done
  assert caplog.records[0].getMessage().endswith(
      'lies before step 11, where the run resumes; the run has no steps left after step 10')

  off = trace.StepTrace(str(tmp_path / 'off'), first_step=0, num_steps=0)
  off.before(1)
  off.after(1)
  off.close()
  assert not os.path.exists(tmp_path / 'off')
  with pytest.raises(ValueError, match='profile_first_step'):
    trace.StepTrace(str(tmp_path), first_step=0, num_steps=3)
  with pytest.raises(ValueError, match='profile_first_step -3'):  # a typo, traced or not
    trace.validate(-3, 0)
  # A first step without a step count: nothing traced, and the run says why.
  caplog.clear()
  assert trace.StepTrace(str(tmp_path / 'no_steps'), first_step=100, num_steps=0).done
  assert [r.getMessage() for r in caplog.records] == [
      'No profiler trace in this run: profile_first_step is 100 but profile_steps is 0; set '
      '--config.profile_steps to the number of steps to trace'
  ]


def test_a_trace_window_after_the_last_step_is_refused():
  trace.validate(10, 5, last_step=10)  # the last step alone: traced
  trace.validate(11, 0, last_step=10)  # no trace asked for
  trace.validate(11, 5)  # the run's length unknown
  with pytest.raises(ValueError, match="profile_first_step 11 is after the run's last step 10"):
    trace.validate(11, 5, last_step=10)
