"""XLA's planned temporaries of a small ViT's gradient step, for tests of the models'
memory choices."""
import jax
import jax.numpy as jnp

from vit_jax import models


def vit_step_temporaries_mb(dtype):
  """ViT-Ti/16 with 3 blocks of 257 tokens (4x4 patches of 64x64 images, batch 4), so that
  the blocks' saved values, not the patch embedding, make the peak."""
  model = models.get_model('ViT-Ti_16', num_classes=3, num_layers=3, patch_size=4, dtype=dtype)
  x = jnp.ones((4, 64, 64, 3))
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x[:1], train=False))
  loss = lambda p, x: jnp.sum(model.apply(p, x, train=False).astype(jnp.float32)**2)
  compiled = jax.jit(jax.grad(loss)).lower(params, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 1e6
