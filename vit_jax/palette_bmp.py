"""BMP files whose pixels index a colour table (1, 4 or 8 bits per pixel), as TF ops.

TensorFlow's BMP decoder reads an 8-bit BMP's colour indices as gray values, so a colour
one comes out as a gray image of its indices without an error, and it refuses 1- and
4-bit BMPs. These ops read the header, the table and the rows of uncompressed 1-, 4- and
8-bit BMPs (BITMAPINFOHEADER or later; bottom-up or top-down rows) into uint8 [H, W, 3];
a damaged or run-length-encoded one fails as any undecodable image does. 24- and 32-bit
BMPs are TensorFlow's; it refuses 16-bit ones.

Where BMPs can be met, image folders (data_sources) and the files of vit-predict and
vit-inspect (image_files), the bytes of a palette BMP are replaced by a PNG of its colours
(`as_png`) before preprocessing decodes them: TFDS datasets hold no BMPs, so their decode
does not pay for the check (~0.2 ms of CPU per image).
"""
import tensorflow as tf

_HEADER_BYTES = 54  # the file header (14) and a BITMAPINFOHEADER (40)


def _header(data: tf.Tensor) -> tf.Tensor:
  """The first 54 bytes as uint8 [54], zero-padded where the file is shorter."""
  head = tf.strings.join([tf.strings.substr(data, 0, _HEADER_BYTES), b'\0' * _HEADER_BYTES])
  head = tf.strings.substr(head, 0, _HEADER_BYTES)
  return tf.io.decode_raw(head, tf.uint8)


def _field(head: tf.Tensor, offset: int, size: int) -> tf.Tensor:
  """An unsigned little-endian field of the header as int64."""
  data = tf.cast(head[offset:offset + size], tf.int64)
  return tf.reduce_sum(data * (256**tf.range(size, dtype=tf.int64)))


def unreadable(head: bytes) -> tuple[str, str] | None:
  """Why a BMP, from its first 34 bytes, cannot be decoded here, and what to do; None where
  it can (or where it is not a BMP)."""
  if not head.startswith(b'BM') or len(head) < 34:
    return None
  bits, compression = int.from_bytes(head[28:30], 'little'), int.from_bytes(head[30:34], 'little')
  if bits not in (1, 4, 8, 24, 32):
    return f'a {bits}-bit BMP, which is not read', 'save it as a 24-bit BMP, a PNG or a JPEG'
  if bits <= 8 and compression != 0:
    return 'a run-length-encoded BMP, which is not read', 'save it uncompressed, as a PNG or a JPEG'
  return None


def is_palette_bmp(data: tf.Tensor) -> tf.Tensor:
  """bool: a BMP of 1, 4 or 8 bits per pixel (a table of colours)."""
  head = _header(data)
  bits = _field(head, 28, 2)
  return ((head[0] == ord('B')) & (head[1] == ord('M')) &
          ((bits == 1) | (bits == 4) | (bits == 8)) & (_field(head, 14, 4) >= 40))


def decode(data: tf.Tensor) -> tf.Tensor:
  """A palette BMP's bytes -> uint8 [H, W, 3]."""
  head = _header(data)
  bits = _field(head, 28, 2)
  width = _field(head, 18, 4)
  height = _field(head, 22, 4)
  height = tf.where(height >= 2**31, height - 2**32, height)  # negative: rows top-down
  rows = tf.abs(height)
  colours = _field(head, 46, 4)
  colours = tf.where(colours == 0, 2**bits, colours)
  table = tf.io.decode_raw(tf.strings.substr(data, 14 + _field(head, 14, 4), 4 * colours), tf.uint8)
  rgb = tf.reverse(tf.reshape(table, [-1, 4])[:, :3], axis=[1])  # stored as B, G, R, 0
  stride = (width * bits + 31) // 32 * 4  # each row is padded to 4 bytes
  pixels = tf.io.decode_raw(tf.strings.substr(data, _field(head, 10, 4), stride * rows), tf.uint8)
  pixels = tf.reshape(pixels, tf.stack([rows, stride]))
  per_byte = 8 // bits
  shifts = tf.cast(8 - bits * (tf.range(per_byte, dtype=tf.int64) + 1), tf.uint8)  # leftmost first
  mask = tf.cast(2**bits - 1, tf.uint8)
  indices = tf.bitwise.bitwise_and(tf.bitwise.right_shift(pixels[:, :, None], shifts), mask)
  indices = tf.reshape(indices, tf.stack([rows, stride * per_byte]))[:, :width]
  indices = tf.cond(height > 0, lambda: tf.reverse(indices, axis=[0]), lambda: indices)
  uncompressed = tf.debugging.assert_equal(_field(head, 30, 4), tf.constant(0, tf.int64),
                                           message='a run-length-encoded BMP')
  with tf.control_dependencies([uncompressed]):
    return tf.gather(rgb, tf.cast(indices, tf.int32))


def as_png(data: tf.Tensor) -> tf.Tensor:
  """Encoded image bytes, with a palette BMP's replaced by a PNG of its colours."""
  return tf.cond(is_palette_bmp(data), lambda: tf.io.encode_png(decode(data)), lambda: data)
