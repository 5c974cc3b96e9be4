"""XLA's planned temporaries of small models' gradient steps, for tests of the models'
memory choices."""
import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax import models
from vit_jax.models import resnet


def _gradient_temporaries_mb(model, **apply_kwargs):
  """MB of temporaries XLA plans for the gradient of sum(model(x)^2) on 4 64x64 images."""
  x = jnp.ones((4, 64, 64, 3))
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x[:1], **apply_kwargs))
  loss = lambda p, x: jnp.sum(model.apply(p, x, **apply_kwargs).astype(jnp.float32)**2)
  compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 1e6


def vit_step_temporaries_mb(dtype):
  """ViT-Ti/16 with 3 blocks of 257 tokens (4x4 patches of 64x64 images, batch 4), so that
  the blocks' saved values, not the patch embedding, make the peak."""
  model = models.get_model('ViT-Ti_16', num_classes=3, num_layers=3, patch_size=4, dtype=dtype)
  return _gradient_temporaries_mb(model, train=False)


def resnet_step_temporaries_mb(dtype):
  """The hybrids' ResNet root and one stage of two units (64 features) on 64x64 images,
  batch 4: where the GroupNorms and ReLUs keep what the backward needs."""

  class Stem(nn.Module):

    @nn.compact
    def __call__(self, x):
      return resnet.resnet_stem(x, (2,), 1, dtype=dtype)

  return _gradient_temporaries_mb(Stem())
