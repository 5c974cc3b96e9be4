"""PyTorch's model for the benchmarks' PyTorch sides (vs_pytorch.py, device_time.py): timm's
where `import timm` works, else a MINIMAL PYTORCH VIT in timm's structure (fused qkv Linear +
F.scaled_dot_product_attention, LayerNorm 1e-6, tanh-GELU MLP; hybrid: weight-standardised
convs, GroupNorm 32, TF-SAME padding, post-activation bottlenecks), with the vit_jax model's
parameter count. timm 1.0.x imports torchvision at import time, and there is no CPU
torchvision build here.

Imports torch, not JAX.
"""
import torch
from torch import nn
import torch.nn.functional as F

import harness


class Attention(nn.Module):

  def __init__(self, dim, heads):
    super().__init__()
    self.heads = heads
    self.qkv = nn.Linear(dim, 3 * dim)
    self.proj = nn.Linear(dim, dim)

  def forward(self, x):
    b, n, c = x.shape
    qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
    x = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
    return self.proj(x.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):

  def __init__(self, dim, mlp_dim, heads):
    super().__init__()
    self.norm1 = nn.LayerNorm(dim, eps=1e-6)
    self.attn = Attention(dim, heads)
    self.norm2 = nn.LayerNorm(dim, eps=1e-6)
    self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(approximate='tanh'),
                             nn.Linear(mlp_dim, dim))

  def forward(self, x):
    x = x + self.attn(self.norm1(x))
    return x + self.mlp(self.norm2(x))


def same_pad(x, k, s, value=0.0):
  pads = []
  for size in (x.shape[-1], x.shape[-2]):  # F.pad order: last dim first
    out = -(-size // s)
    total = max((out - 1) * s + k - size, 0)
    pads += [total // 2, total - total // 2]
  return F.pad(x, pads, value=value) if any(pads) else x


class StdConv(nn.Conv2d):

  def __init__(self, cin, cout, k, s=1):
    super().__init__(cin, cout, k, s, padding=0, bias=False)

  def forward(self, x):
    w = self.weight
    w = w - w.mean(dim=(1, 2, 3), keepdim=True)
    w = w / (w.square().mean(dim=(1, 2, 3), keepdim=True).sqrt() + 1e-5)
    x = same_pad(x, self.kernel_size[0], self.stride[0])
    return F.conv2d(x, w, None, self.stride)


class Unit(nn.Module):

  def __init__(self, cin, mid, stride):
    super().__init__()
    self.proj = None
    if cin != 4 * mid or stride != 1:
      self.proj = nn.Sequential(StdConv(cin, 4 * mid, 1, stride), nn.GroupNorm(32, 4 * mid))
    self.conv1, self.gn1 = StdConv(cin, mid, 1), nn.GroupNorm(32, mid)
    self.conv2, self.gn2 = StdConv(mid, mid, 3, stride), nn.GroupNorm(32, mid)
    self.conv3, self.gn3 = StdConv(mid, 4 * mid, 1), nn.GroupNorm(32, 4 * mid)

  def forward(self, x):
    r = x if self.proj is None else self.proj(x)
    y = F.relu(self.gn1(self.conv1(x)))
    y = F.relu(self.gn2(self.conv2(y)))
    return F.relu(r + self.gn3(self.conv3(y)))


class Stem(nn.Module):

  def __init__(self, layers, width=64):
    super().__init__()
    self.conv, self.gn = StdConv(3, width, 7, 2), nn.GroupNorm(32, width)
    units, cin = [], width
    for i, n in enumerate(layers):
      for j in range(n):
        units.append(Unit(cin, width * 2**i, 2 if i and not j else 1))
        cin = 4 * width * 2**i
    self.units = nn.Sequential(*units)
    self.out_channels = cin

  def forward(self, x):
    x = F.relu(self.gn(self.conv(x)))
    x = F.max_pool2d(same_pad(x, 3, 2, float('-inf')), 3, 2)
    return self.units(x)


class ViT(nn.Module):

  def __init__(self, f, image_size, num_classes):
    super().__init__()
    d, p = f['hidden_size'], f['patch_size']
    self.stem = None
    cin, size = 3, image_size
    if f['resnet_layers'] is not None:
      self.stem = Stem(f['resnet_layers'], int(64 * f['resnet_width']))
      cin = self.stem.out_channels
      size = image_size // (4 * 2**max(len(f['resnet_layers']) - 1, 0))
    self.patch = nn.Conv2d(cin, d, p, p)
    n = (size // p)**2 + 1
    self.cls = nn.Parameter(torch.zeros(1, 1, d))
    self.pos = nn.Parameter(torch.randn(1, n, d) * 0.02)
    self.blocks = nn.Sequential(
        *[Block(d, f['mlp_dim'], f['num_heads']) for _ in range(f['num_layers'])])
    self.norm = nn.LayerNorm(d, eps=1e-6)
    self.head = nn.Linear(d, num_classes)

  def forward(self, x):
    if self.stem is not None:
      x = self.stem(x)
    x = self.patch(x).flatten(2).transpose(1, 2)
    x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
    x = self.norm(self.blocks(x))
    return self.head(x[:, 0])


def create(name, fields, image_size, impl='auto', overrides=None):
  """(model, label, note): timm's model for `name` (impl 'timm', or 'auto' where timm imports
  and has it), else the minimal ViT of the variant's `fields` (vit_jax.models.get_variant's);
  the note says why timm was not used."""
  note = ''
  if impl in ('auto', 'timm'):
    try:
      import timm  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      if impl == 'timm':
        raise
      note = f'timm not importable ({e}); minimal PyTorch ViT used'
    else:
      if name in harness.TIMM_NAMES and not overrides:
        model = timm.create_model(harness.TIMM_NAMES[name], pretrained=False, num_classes=1000)
        return model, f'timm {timm.__version__} {harness.TIMM_NAMES[name]}', note
      note = f'timm has no model for {name} with overrides {overrides}; minimal PyTorch ViT used'
  return ViT(fields, image_size, 1000), 'minimal PyTorch ViT (timm structure)', note
