"""Model zoo: `get_model(name, num_classes, **overrides)` -> a flax.linen Module.

    model = models.get_model('ViT-B_16', num_classes=1000)
    logits = model.apply({'params': params}, images, train=False)  # images NHWC in [-1, 1]
"""
import jax.numpy as jnp

from vit_jax.models import remat
from vit_jax.models.bit import BiTResNet
from vit_jax.models.variants import VARIANTS, describe, get_variant, pixels_per_token
from vit_jax.models.vit import VisionTransformer

# Options of the module that are not architecture fields of the variant table.
_MODULE_OPTIONS = ('head_bias_init', 'dtype', 'remat')
# The compute dtypes a model takes by name (config.dtype); parameters stay float32.
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


def get_model(name, num_classes, **overrides):
  """The flax module for variant `name` with `num_classes` outputs (0: features).

  `overrides` replace variant fields (patch_size, classifier, representation_size,
  dropout_rate, ...) or set module options: head_bias_init, dtype ('float32',
  'bfloat16' or a jnp dtype; parameters stay float32), remat (a policy name of
  models/remat.py, '' for none, or True/False).
  """
  options = {k: overrides.pop(k) for k in _MODULE_OPTIONS if k in overrides}
  if 'remat' in options:
    options['remat'] = remat.policy_name(options['remat'])
  if isinstance(options.get('dtype'), str):
    if options['dtype'] not in DTYPES:
      raise ValueError(
          f'dtype {options["dtype"]!r} is not supported: use one of {", ".join(DTYPES)}')
    options['dtype'] = DTYPES[options['dtype']]
  fields = get_variant(name, **overrides)
  family = fields.pop('family')
  cls = VisionTransformer if family == 'vit' else BiTResNet
  return cls(num_classes=num_classes, **fields, **options)


def from_config(config, num_classes):
  """The model a training config describes: model_name, model (overrides), dtype, remat,
  head_bias_init."""
  return get_model(config.model_name, num_classes, dtype=config.dtype, remat=config.remat,
                   head_bias_init=config.head_bias_init, **config.model)


__all__ = [
    'VARIANTS', 'describe', 'from_config', 'get_model', 'get_variant', 'pixels_per_token',
    'VisionTransformer', 'BiTResNet'
]
