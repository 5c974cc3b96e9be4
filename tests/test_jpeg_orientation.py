"""vit_jax/jpeg_orientation.py: the EXIF orientation tag read from a JPEG's bytes, and the
stored pixels turned as PIL's ImageOps.exif_transpose (what image viewers do) turns them."""
import io
import struct

import numpy as np
import pytest
from PIL import Image
from PIL import ImageOps

from vit_jax import jpeg_orientation


def _jpeg(pixels, exif=None):
  buf = io.BytesIO()
  Image.fromarray(pixels).save(buf, 'JPEG', quality=95, **({'exif': exif} if exif else {}))
  return buf.getvalue()


def _stored():
  """A 12x20 image whose every turn and mirror differs from the others."""
  rng = np.random.default_rng(0)
  return rng.integers(0, 256, (12, 20, 3), dtype=np.uint8)


@pytest.mark.parametrize('tag', range(1, 9))
def test_each_orientation_turns_as_image_viewers_do(tag):
  exif = Image.Exif()
  exif[0x0112] = tag
  data = _jpeg(_stored(), exif.tobytes())
  assert jpeg_orientation.orientation(data) == tag
  decoded = np.asarray(Image.open(io.BytesIO(data)).convert('RGB'))
  expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert('RGB'))
  turned = jpeg_orientation.upright(decoded, tag)
  assert turned.shape == expected.shape and (turned == expected).all()
  assert turned.flags['C_CONTIGUOUS']


def _exif_block(order, tag_value, extra_entries=()):
  """An EXIF block of byte order `order` ('<' II, '>' MM) with one IFD: `extra_entries`
  (tag, value) and the Orientation tag."""
  entries = [*extra_entries, (0x0112, tag_value)]
  ifd = struct.pack(order + 'H', len(entries)) + b''.join(
      struct.pack(order + 'HHI', tag, 3, 1) + struct.pack(order + 'H', value) + b'\0\0'
      for tag, value in entries) + b'\0\0\0\0'
  head = (b'II' if order == '<' else b'MM') + struct.pack(order + 'HI', 42, 8)
  return b'Exif\0\0' + head + ifd


def _with_app1(jpeg, block):
  """The JPEG with an APP1 segment holding `block` right after its start-of-image marker."""
  return jpeg[:2] + b'\xff\xe1' + struct.pack('>H', len(block) + 2) + block + jpeg[2:]


@pytest.mark.parametrize('order', ['<', '>'])
def test_both_byte_orders_and_a_tag_after_others(order):
  plain = _jpeg(_stored())
  assert jpeg_orientation.orientation(plain) == 1  # no EXIF: as stored
  block = _exif_block(order, 6, extra_entries=[(0x0100, 20), (0x0101, 12)])
  assert jpeg_orientation.orientation(_with_app1(plain, block)) == 6


@pytest.mark.parametrize('damage', ['cut', 'bad_order', 'out_of_range', 'no_ifd'])
def test_damaged_exif_is_taken_as_stored(damage):
  """A viewer shows such a file as stored; so does vit-predict, without an error."""
  plain = _jpeg(_stored())
  block = _exif_block('<', 0 if damage == 'out_of_range' else 6)
  block = {
      'cut': block[:14],
      'bad_order': block[:6] + b'XX' + block[8:],
      'out_of_range': block,
      'no_ifd': block[:10] + struct.pack('<I', 10_000) + block[14:],
  }[damage]
  assert jpeg_orientation.orientation(_with_app1(plain, block)) == 1


@pytest.mark.parametrize(
    'save',
    [
        dict(),
        dict(progressive=True),  # its frame is an SOF2 segment
        dict(exif=b'Exif\0\0MM\0*\0\0\0\x08\0\0\0\0\0\0'),  # a segment before the frame
    ])
def test_the_frame_size_is_read_from_the_header(save):
  buf = io.BytesIO()
  Image.fromarray(_stored()).save(buf, 'JPEG', **save)
  assert jpeg_orientation.frame_size(buf.getvalue()) == (12, 20)
  gray = io.BytesIO()
  Image.fromarray(_stored()[..., 0]).save(gray, 'JPEG', **save)
  assert jpeg_orientation.frame_size(gray.getvalue()) == (12, 20)


def test_a_header_without_a_frame_has_no_size():
  data = _jpeg(_stored())
  frame = data.index(b'\xff\xc0')
  assert jpeg_orientation.frame_size(data[:frame + 6]) is None  # cut inside the frame
  assert jpeg_orientation.frame_size(data[:frame]) is None
