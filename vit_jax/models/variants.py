"""The one table of model variants: name -> architecture fields.

Names are the stems of the published checkpoint files (ViT-B_16.npz, R50+ViT-B_16.npz,
BiT-M-R50x1.npz) and the paper's ResNet baselines (R50x1 ... R200x3, Table 6).
Training settings (dropout rates, head bias) are not architecture: they default to 0
here and come from the configs.
"""
import difflib
import numbers

# ViT sizes (Table 1, plus Ti and S): hidden_size, mlp_dim, num_heads, num_layers.
VIT_SIZES = {
    'Ti': dict(hidden_size=192, mlp_dim=768, num_heads=3, num_layers=12),
    'S': dict(hidden_size=384, mlp_dim=1536, num_heads=6, num_layers=12),
    'B': dict(hidden_size=768, mlp_dim=3072, num_heads=12, num_layers=12),
    'L': dict(hidden_size=1024, mlp_dim=4096, num_heads=16, num_layers=24),
    'H': dict(hidden_size=1280, mlp_dim=5120, num_heads=16, num_layers=32),
}
VIT_PATCHES = (8, 14, 16, 32)  # Every plain ViT size comes with each; all divide 224.

# Every ViT-family field, with its default. `resnet_layers` None means no ResNet stem;
# a tuple (possibly empty: root only) makes a hybrid.
VIT_DEFAULTS = dict(
    family='vit',
    patch_size=16,
    classifier='token',  # 'token' (class token) or 'gap' (global average pooling).
    representation_size=None,  # Pre-logits Dense+tanh of this size; None: none.
    dropout_rate=0.0,
    attention_dropout_rate=0.0,
    resnet_layers=None,
    resnet_width=1,
    **VIT_SIZES['B'],
)

BIT_DEFAULTS = dict(
    family='bit',
    resnet_layers=(3, 4, 6, 3),
    resnet_width=1,
)

_BIT_DEPTHS = {
    26: (2, 2, 2, 2),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
    200: (3, 24, 36, 3),
}
# (depth, width) of the published BiT-S/BiT-M files and of the paper's ResNet baselines.
_BIT_FILES = ((50, 1), (50, 3), (101, 1), (101, 3), (152, 2), (152, 4))
_RESNET_BASELINES = ((50, 1), (50, 2), (101, 1), (152, 1), (152, 2), (200, 3))  # Table 6.


def _vit(size, patch, **fields):
  return {**VIT_DEFAULTS, **VIT_SIZES[size], 'patch_size': patch, **fields}


def _bit(depth, width):
  return {**BIT_DEFAULTS, 'resnet_layers': _BIT_DEPTHS[depth], 'resnet_width': width}


VARIANTS = {
    # Plain ViTs: every size with every patch size.
    **{
        f'ViT-{s}_{p}': _vit(s, p) for s in VIT_SIZES for p in VIT_PATCHES
    },
    # Hybrids: ResNet stem (GN + weight-standardised convs), then ViT on its feature map.
    # The name's patch size is the effective one, stem stride x patch_size (see
    # pixels_per_token), except for R+ViT-Ti_16, named as published: 4 x 8 = 32.
    # /16: stage 4 removed and its units moved to stage 3 (3, 4, 9); /32: the full R50
    # (paper Section 4.1, options (ii) and (i)); 1x1 patches on the feature map.
    'R50+ViT-B_16': _vit('B', 1, resnet_layers=(3, 4, 9)),
    'R50+ViT-B_32': _vit('B', 1, resnet_layers=(3, 4, 6, 3)),
    'R50+ViT-L_16': _vit('L', 1, resnet_layers=(3, 4, 9)),
    'R50+ViT-L_32': _vit('L', 1, resnet_layers=(3, 4, 6, 3)),
    'R26+ViT-B_32': _vit('B', 1, resnet_layers=(2, 2, 2, 2)),
    'R26+ViT-S_32': _vit('S', 1, resnet_layers=(2, 2, 2, 2)),
    # Root block only (conv, GN, ReLU, max-pool: stride 4) and 8x8 patches, as published:
    # 32 pixels per token despite the name.
    'R+ViT-Ti_16': _vit('Ti', 8, resnet_layers=()),
    # BiT ResNet v2 (pre-activation), the published BiT-S/BiT-M files.
    **{
        f'BiT-{d}-R{depth}x{w}': _bit(depth, w) for d in ('S', 'M') for depth, w in _BIT_FILES
    },
    # The paper's ResNet baselines (Table 6): the same BiT family.
    **{
        f'R{depth}x{w}': _bit(depth, w) for depth, w in _RESNET_BASELINES
    },
}

# The type a field takes where its default is None (no pre-logits layer, no ResNet stem).
OPTIONAL_FIELD_TYPES = {'representation_size': int, 'resnet_layers': tuple}


def get_variant(name, **overrides):
  """The fields of variant `name` with `overrides` applied; one-line errors otherwise."""
  if name not in VARIANTS:
    lower = {k.lower(): k for k in VARIANTS}
    close = difflib.get_close_matches(str(name).lower(), lower, n=1, cutoff=0.8)
    guess = f' (did you mean {lower[close[0]]}?)' if close else ''
    raise ValueError(f'Unknown model {name!r}{guess}; known: {", ".join(sorted(VARIANTS))}')
  fields = dict(VARIANTS[name])
  unknown = sorted(set(overrides) - set(fields) - {'family'})
  if unknown:
    allowed = sorted(set(fields) - {'family'})
    raise ValueError(
        f'Unknown field(s) {", ".join(unknown)} for {name} ({fields["family"]} family); '
        f'fields: {", ".join(allowed)}')
  fields.update(overrides)
  if fields['family'] == 'vit' and fields['classifier'] not in ('token', 'gap'):
    raise ValueError(f'classifier {fields["classifier"]!r} is not supported: set '
                     '--config.model.classifier to "token" or "gap"')
  if fields.get('resnet_layers') is not None:
    fields['resnet_layers'] = tuple(fields['resnet_layers'])
  _check_sizes(fields)
  return fields


# Architecture fields that count something: each must be a whole number >= 1.
_COUNTS = ('patch_size', 'hidden_size', 'mlp_dim', 'num_heads', 'num_layers', 'resnet_width')


def _check_sizes(fields):
  """One-line errors for sizes no model can have (as the CLI's --config.model.X names them)."""
  sizes = [(k, fields[k]) for k in _COUNTS if k in fields]
  if fields.get('representation_size') is not None:
    sizes.append(('representation_size', fields['representation_size']))
  sizes += [('resnet_layers', n) for n in fields.get('resnet_layers') or ()]
  for name, value in sizes:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
      raise ValueError(f'model.{name} {value!r} must be a whole number >= 1: set '
                       f'--config.model.{name}')
  if fields['family'] == 'vit' and fields['hidden_size'] % fields['num_heads']:
    raise ValueError(f'model.num_heads {fields["num_heads"]} does not divide model.hidden_size '
                     f'{fields["hidden_size"]} (each head takes hidden_size / num_heads '
                     'channels): set --config.model.num_heads or --config.model.hidden_size')


def describe(name, **overrides):
  """`name`, and the fields `overrides` change from the table, for log lines: e.g.
  'ViT-Ti_16 with patch_size=4, num_layers=4' (a model smaller than its name says)."""
  table, fields = VARIANTS[name], get_variant(name, **overrides)
  changed = [f'{k}={fields[k]}' for k in sorted(overrides) if fields[k] != table[k]]
  return f'{name} with {", ".join(changed)}' if changed else name


def is_plain_vit(name):
  """A ViT of the table without a ResNet stem ('ViT-B_16', not 'R50+ViT-B_16')."""
  fields = VARIANTS.get(name)
  return fields is not None and fields['family'] == 'vit' and fields['resnet_layers'] is None


def pixels_per_token(fields):
  """Side in input pixels of the square one token covers, for variant `fields` (as
  get_variant returns them): the patch size times the hybrid stem's stride (4 for its
  root block, 2 for each stage after the first); 1 for a ResNet, which has no tokens."""
  if fields['family'] != 'vit':
    return 1
  layers = fields['resnet_layers']
  stem = 1 if layers is None else 4 * 2**max(len(layers) - 1, 0)
  return stem * fields['patch_size']
