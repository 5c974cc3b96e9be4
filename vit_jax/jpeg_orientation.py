"""The EXIF orientation of a JPEG file, and its pixels turned as an image viewer shows them;
its frame's size, read from the header (a file too large for TensorFlow's decoder is named
as that, not as damaged).

Cameras and phones store the sensor's rows as they came and record in an EXIF tag
(Orientation, 0x0112) how to turn them for display. TensorFlow's decoders ignore the tag,
so a portrait photo reached vit-predict and vit-inspect lying on its side. The files a user
names are turned upright here; dataset images (TFDS, image folders) are taken as stored,
as TFDS and big_vision take them.

Plain Python over the file's bytes: no TensorFlow, no PIL.
"""
import struct

import numpy as np

_SOS, _APP1 = 0xDA, 0xE1  # start of scan (the pixels follow); the EXIF segment
_ORIENTATION_TAG = 0x0112


def orientation(data: bytes) -> int:
  """The EXIF orientation (1-8) of JPEG bytes; 1 (as stored) without one, or where the
  EXIF data is damaged."""
  try:
    return _orientation(data)
  except (struct.error, IndexError, KeyError, ValueError):
    return 1


def _segments(data):
  """(marker, payload) of each header segment of JPEG bytes, up to the start of scan."""
  pos = 2  # after the start-of-image marker FF D8
  while pos + 4 <= len(data) and data[pos] == 0xFF:
    marker = data[pos + 1]
    if marker == 0xFF:  # fill byte before a marker
      pos += 1
      continue
    if marker == _SOS:
      return
    length, = struct.unpack('>H', data[pos + 2:pos + 4])
    yield marker, data[pos + 4:pos + 2 + length]
    pos += 2 + length


def _orientation(data):
  for marker, segment in _segments(data):
    if marker == _APP1 and segment.startswith(b'Exif\0\0'):
      return _tiff_orientation(segment[6:])
  return 1


# Start-of-frame markers (C0-CF but for C4, C8 and CC, which are other segments).
_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def frame_size(data: bytes):
  """(height, width) of JPEG bytes' frame, from the header; None where none is found or it
  is damaged."""
  try:
    for marker, segment in _segments(data):
      if marker in _FRAMES:
        return struct.unpack('>HH', segment[1:5])  # after the sample precision
  except struct.error:
    pass
  return None


def _tiff_orientation(tiff):
  """The Orientation entry of the first IFD of an EXIF block (a TIFF header and IFDs)."""
  order = {b'II': '<', b'MM': '>'}[tiff[:2]]
  first_ifd, = struct.unpack(order + 'I', tiff[4:8])
  count, = struct.unpack(order + 'H', tiff[first_ifd:first_ifd + 2])
  for i in range(count):
    entry = first_ifd + 2 + 12 * i
    tag, = struct.unpack(order + 'H', tiff[entry:entry + 2])
    if tag == _ORIENTATION_TAG:
      value, = struct.unpack(order + 'H', tiff[entry + 8:entry + 10])  # a SHORT, left-aligned
      return value if 1 <= value <= 8 else 1
  return 1


def upright(image: np.ndarray, orientation_tag: int) -> np.ndarray:
  """Pixels [H, W, C] as stored -> as displayed, for EXIF orientation 1-8 (the row and
  column the tag says the stored first row and column become)."""
  turns = {
      1: lambda x: x,
      2: lambda x: x[:, ::-1],  # mirrored left-right
      3: lambda x: x[::-1, ::-1],  # upside down
      4: lambda x: x[::-1],  # mirrored top-bottom
      5: lambda x: x.transpose(1, 0, 2),  # mirrored along the main diagonal
      6: lambda x: np.rot90(x, -1),  # stored turned 90 degrees counter-clockwise
      7: lambda x: x.transpose(1, 0, 2)[::-1, ::-1],  # mirrored along the other diagonal
      8: lambda x: np.rot90(x, 1),  # stored turned 90 degrees clockwise
  }
  return np.ascontiguousarray(turns[orientation_tag](image))
