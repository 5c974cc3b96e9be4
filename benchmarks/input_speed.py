r"""Images/s of the training and evaluation preprocessing, from local JPEG files.

  python benchmarks/input_speed.py --out /tmp/input_speed.json

Writes --images ImageNet-sized JPEGs (375x500, tests/data_fixtures.write_jpegs) into a
temporary folder and reads them with vit_jax.input_pipeline as the loop does
(`dataset='folder:<dir>'`): train_batches (read, inception crop decoded inside the crop
window, resize to --image_size, random flip, scale to [-1, 1], batch) and eval_batches
(read, full decode, resize or central crop, scale, batch, pad/mask). Every round makes a
fresh iterator for each, takes one batch untimed (pipeline start-up), then times
--batches batches; rounds alternate train, eval, train, eval.
"""
import shutil
import tempfile
import time

import bare_step
import harness

from tests import data_fixtures
from vit_jax import input_pipeline

parser = harness.argument_parser(__doc__)
parser.add_argument('--images', type=harness.positive_int, default=512)
parser.add_argument('--jpeg_size', default='375,500', type=harness.height_width,
                    help='height,width of the JPEGs')
parser.add_argument('--batch', type=harness.positive_int, default=64)
parser.add_argument('--batches', type=harness.positive_int, default=6,
                    help='timed batches per round')
parser.add_argument('--rounds', type=harness.positive_int, default=3)
parser.add_argument('--image_size', type=harness.positive_int, default=224)
parser.add_argument('--eval_crop', default='resize', choices=('resize', 'central'))
parser.add_argument('--out', default='')
args = parser.parse_args()


def timed(iterator, n):
  """(img/s, CPU ms per image: all threads of this process, tf.data's included)."""
  next(iterator)  # start-up, untimed
  t, cpu = time.perf_counter(), time.process_time()
  images = 0
  for _ in range(n):
    images += len(next(iterator)['label'])
  return images / (time.perf_counter() - t), 1e3 * (time.process_time() - cpu) / images


def main():
  bare_step.setup(1)
  load_start = harness.loadavg()
  tmp = tempfile.mkdtemp(prefix='vit_bench_pp_')
  try:
    h, w = args.jpeg_size
    t = time.perf_counter()
    data_fixtures.write_jpegs(tmp, args.images, height=h, width=w)
    write_s = time.perf_counter() - t
    config = bare_step.make_config('ViT-B_16', args.batch, image_size=args.image_size)
    config.dataset = f'folder:{tmp}'
    config.train_split = 'train'
    config.eval_split = 'train'
    config.shuffle_buffer = args.images
    config.pp.eval_crop = args.eval_crop
    # Eval reads the split once: cap the timed batches at what one pass yields.
    eval_batches = min(args.batches, args.images // args.batch - 1)
    train_rates, eval_rates, train_cpu, eval_cpu = [], [], [], []
    for r in range(args.rounds):
      rate, cpu = timed(
          input_pipeline.train_batches(config, global_batch=args.batch, start_step=r *
                                       (args.batches + 1)), args.batches)
      train_rates.append(rate)
      train_cpu.append(cpu)
      rate, cpu = timed(input_pipeline.eval_batches(config, global_batch=args.batch), eval_batches)
      eval_rates.append(rate)
      eval_cpu.append(cpu)
      print(
          f'round {r + 1}/{args.rounds}: train {train_rates[-1]:.0f} img/s '
          f'({train_cpu[-1]:.2f} CPU ms/img), eval {eval_rates[-1]:.0f} img/s '
          f'({eval_cpu[-1]:.2f} CPU ms/img)', flush=True)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  load_end = harness.loadavg()
  train_med = harness.summary(train_rates)['median']
  payload = {
      'benchmark': 'input_speed',
      'machine': bare_step.machine_info(),
      'args': vars(args),
      'loadavg_start': load_start,
      'loadavg_end': load_end,
      'jpeg_write_s': write_s,
      'train_img_s_per_round': train_rates,
      'eval_img_s_per_round': eval_rates,
      'train_img_s_median': train_med,
      'train_cpu_ms_per_image': train_cpu,
      'eval_cpu_ms_per_image': eval_cpu,
      'eval_img_s_median': harness.summary(eval_rates)['median'],
      'eval_over_train_per_round': [e / t for t, e in zip(train_rates, eval_rates)],
      'target_train_1000_met': train_med >= 1000
  }
  print(f'\n### input pipeline ({args.images} JPEGs {h}x{w} -> {args.image_size}, batch '
        f'{args.batch}, {harness.cores()} cores)\n')
  print(
      harness.markdown_table(
          ['preprocessing', 'img/s median (min–max over rounds)', 'per round', 'CPU ms per image'],
          [[
              'train: inception crop + resize + flip',
              harness.fmt_range(train_rates, '.0f'), ', '.join(f'{x:.0f}' for x in train_rates),
              harness.fmt_range(train_cpu)
          ],
           [
               f'eval: decode + {args.eval_crop}',
               harness.fmt_range(eval_rates, '.0f'), ', '.join(f'{x:.0f}' for x in eval_rates),
               harness.fmt_range(eval_cpu)
           ]]))
  print(f'\ntrain target ≥1000 img/s: {"met" if train_med >= 1000 else "MISSED"}; '
        f'loadavg start {load_start[0]:.2f}, end {load_end[0]:.2f}')
  harness.write_json(args.out, payload)


if __name__ == '__main__':
  main()
