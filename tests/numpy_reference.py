"""An independent NumPy forward pass of ViT, hybrid and BiT, written from the papers.

It reads the flat published-format key names directly (the .npz layout), so it checks
both the Flax modules' numerics and checkpoint.load_npz's mapping. float64 throughout.
"""
import math

import numpy as np


def layer_norm(x, scale, bias, eps=1e-6):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu)**2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * scale + bias


def gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def conv2d(x, w, stride, pads, bias=None):
  """NHWC x HWIO with explicit ((top, bottom), (left, right)) zero padding."""
  x = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
  kh, kw, _, cout = w.shape
  n, h, wd, _ = x.shape
  oh, ow = (h - kh) // stride + 1, (wd - kw) // stride + 1
  out = np.zeros((n, oh, ow, cout))
  for i in range(kh):
    for j in range(kw):
      patch = x[:, i:i + stride * oh:stride, j:j + stride * ow:stride, :]
      out += patch @ w[i, j]
  return out if bias is None else out + bias


def tf_same_pads(size, k, stride):
  out = -(-size // stride)
  total = max((out - 1) * stride + k - size, 0)
  return (total // 2, total - total // 2)


def max_pool(x, k, stride, pads, fill):
  x = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)), constant_values=fill)
  n, h, w, c = x.shape
  oh, ow = (h - k) // stride + 1, (w - k) // stride + 1
  out = np.full((n, oh, ow, c), -np.inf)
  for i in range(k):
    for j in range(k):
      out = np.maximum(out, x[:, i:i + stride * oh:stride, j:j + stride * ow:stride, :])
  return out


def group_norm(x, scale, bias, groups=32, eps=1e-6):
  n, h, w, c = x.shape
  g = x.reshape(n, h, w, groups, c // groups)
  mu = g.mean(axis=(1, 2, 4), keepdims=True)
  var = g.var(axis=(1, 2, 4), keepdims=True)
  g = (g - mu) / np.sqrt(var + eps)
  return g.reshape(n, h, w, c) * scale.reshape(-1) + bias.reshape(-1)


def standardize(w, eps, in_sqrt):
  mu = w.mean(axis=(0, 1, 2), keepdims=True)
  sd2 = w.var(axis=(0, 1, 2), keepdims=True)
  return (w - mu) / (np.sqrt(sd2 + eps) if in_sqrt else np.sqrt(sd2) + eps)


def _hybrid_conv(p, x, name, stride):
  w = standardize(p[f'{name}/kernel'], 1e-5, False)
  k = w.shape[0]
  pads = (tf_same_pads(x.shape[1], k, stride), tf_same_pads(x.shape[2], k, stride))
  return conv2d(x, w, stride, pads)


def hybrid_stem(p, x, layers):
  relu = lambda y: np.maximum(y, 0)
  gn = lambda y, name: group_norm(y, p[f'{name}/scale'], p[f'{name}/bias'])
  x = relu(gn(_hybrid_conv(p, x, 'conv_root', 2), 'gn_root'))
  pads = (tf_same_pads(x.shape[1], 3, 2), tf_same_pads(x.shape[2], 3, 2))
  x = max_pool(x, 3, 2, pads, -np.inf)
  for i, units in enumerate(layers):
    for j in range(units):
      u = f'block{i + 1}/unit{j + 1}'
      stride = 2 if (i > 0 and j == 0) else 1
      res = x
      if f'{u}/conv_proj/kernel' in p:
        res = gn(_hybrid_conv(p, x, f'{u}/conv_proj', stride), f'{u}/gn_proj')
      y = relu(gn(_hybrid_conv(p, x, f'{u}/conv1', 1), f'{u}/gn1'))
      y = relu(gn(_hybrid_conv(p, y, f'{u}/conv2', stride), f'{u}/gn2'))
      y = gn(_hybrid_conv(p, y, f'{u}/conv3', 1), f'{u}/gn3')
      x = relu(res + y)
  return x


def vit_forward(p, images, *, patch, heads, classifier='token', resnet_layers=None):
  """Logits of a ViT/hybrid from its flat published-format parameters `p`."""
  x = images.astype(np.float64)
  if resnet_layers is not None:
    x = hybrid_stem(p, x, resnet_layers)
  x = conv2d(x, p['embedding/kernel'], patch, ((0, 0), (0, 0)), p['embedding/bias'])
  n, h, w, d = x.shape
  x = x.reshape(n, h * w, d)
  if classifier == 'token':
    x = np.concatenate([np.broadcast_to(p['cls'], (n, 1, d)), x], axis=1)
  x = x + p['Transformer/posembed_input/pos_embedding']
  i = 0
  while f'Transformer/encoderblock_{i}/LayerNorm_0/scale' in p:
    b = f'Transformer/encoderblock_{i}/'
    y = layer_norm(x, p[b + 'LayerNorm_0/scale'], p[b + 'LayerNorm_0/bias'])
    a = b + 'MultiHeadDotProductAttention_1/'
    q, k, v = (np.einsum('btd,dhk->bthk', y, p[a + f'{s}/kernel']) + p[a + f'{s}/bias']
               for s in ('query', 'key', 'value'))
    att = softmax(np.einsum('bqhk,bthk->bhqt', q, k) / math.sqrt(q.shape[-1]))
    y = np.einsum('bhqt,bthk->bqhk', att, v)
    x = x + np.einsum('bqhk,hkd->bqd', y, p[a + 'out/kernel']) + p[a + 'out/bias']
    y = layer_norm(x, p[b + 'LayerNorm_2/scale'], p[b + 'LayerNorm_2/bias'])
    y = gelu_tanh(y @ p[b + 'MlpBlock_3/Dense_0/kernel'] + p[b + 'MlpBlock_3/Dense_0/bias'])
    x = x + y @ p[b + 'MlpBlock_3/Dense_1/kernel'] + p[b + 'MlpBlock_3/Dense_1/bias']
    i += 1
  x = layer_norm(x, p['Transformer/encoder_norm/scale'], p['Transformer/encoder_norm/bias'])
  x = x[:, 0] if classifier == 'token' else x.mean(1)
  if 'pre_logits/kernel' in p:
    x = np.tanh(x @ p['pre_logits/kernel'] + p['pre_logits/bias'])
  return x @ p['head/kernel'] + p['head/bias']


def bit_forward(p, images, layers):
  """Logits of a BiT ResNet v2 from its flat BiT-file (TF-named) parameters `p`."""
  relu = lambda y: np.maximum(y, 0)
  pre = 'resnet/'
  gn = lambda y, name: group_norm(y, p[name + '/gamma'], p[name + '/beta'], eps=1e-5)
  conv = lambda y, name, stride, pad: conv2d(
      y, standardize(p[name + '/standardized_conv2d/kernel'], 1e-10, True), stride, ((pad, pad),
                                                                                     (pad, pad)))
  x = conv(images.astype(np.float64), pre + 'root_block', 2, 3)
  x = max_pool(x, 3, 2, ((1, 1), (1, 1)), 0.0)  # zero padding, then VALID pool
  for i, units in enumerate(layers):
    for j in range(units):
      u = f'{pre}block{i + 1}/unit{j + 1:02d}/'
      stride = 2 if (i > 0 and j == 0) else 1
      out = relu(gn(x, u + 'a/group_norm'))
      res = conv(out, u
                 + 'a/proj', stride, 0) if (u + 'a/proj/standardized_conv2d/kernel') in p else x
      y = conv(out, u + 'a', 1, 0)
      y = conv(relu(gn(y, u + 'b/group_norm')), u + 'b', stride, 1)
      y = conv(relu(gn(y, u + 'c/group_norm')), u + 'c', 1, 0)
      x = y + res
  x = relu(gn(x, pre + 'group_norm')).mean(axis=(1, 2))
  k = p[pre + 'head/conv2d/kernel']
  return x @ k.reshape(k.shape[-2:]) + p[pre + 'head/conv2d/bias']
