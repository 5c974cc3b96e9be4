r"""Table 2's ImageNet fine-tuning recipe (Appendix B.1.1), the paper's headline numbers.

  --config=table2:<model>          ViT-L_16 (at 512) or ViT-H_14 (at 518)
  e.g. vit-train --config=table2:ViT-L_16 --config.data_dir=gs://my-bucket/tfds --workdir=...

Table 4's ImageNet row (configs/finetune.py: SGD momentum 0.9, batch 512, 20k steps,
cosine decay, clipping at 1, base_lr from {0.003, 0.01, 0.03, 0.06}) plus the two
"additional techniques" that Table 5's caption names as the difference to Table 2:
- the resolution: 512 for ViT-L/16 (32 x 32 tokens) and 518 for ViT-H/14 (37 x 37);
- Polyak averaging of the parameters with factor 0.9999 (vit_jax/polyak.py); the
  average is what is evaluated and written to final.npz.
Table 2 also reports ImageNet ReaL, so eval_real is on (off with 'dev'):
imagenet2012_real must be prepared in data_dir beside imagenet2012
(--config.eval_real=False to skip it).
The published ImageNet-21k checkpoints stand in for the JFT-300M ones, which are not
public: ViT-L_16 gives Table 2's "ViT-L/16 (I21k)" column (85.30 on ImageNet).
"""
from vit_jax import configs
from vit_jax.configs import finetune

RESOLUTION = {'ViT-L_16': 512, 'ViT-H_14': 518}  # B.1.1
POLYAK_DECAY = 0.9999  # B.1.1


def get_config(arg=None):
  """Config of one Table 2 ImageNet row; arg is '<model>[,dev]'."""
  parts = [p.strip() for p in (arg or '').split(',')]
  if parts[0] not in RESOLUTION or len(parts) > 2 or parts[1:] not in ([], ['dev']):
    raise configs.bad_argument(
        'table2', arg, '--config=table2:<model>[,dev] with a model '
        f'among: {" ".join(RESOLUTION)}')
  c = finetune.get_config(','.join([parts[0], 'imagenet2012', *parts[1:]]))
  c.image_size = RESOLUTION[parts[0]]
  c.polyak_decay = POLYAK_DECAY
  c.eval_real = len(parts) == 1  # 'dev' chooses base_lr on train[99%:]: no test-set peeking
  return c
