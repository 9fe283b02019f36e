"""zstd as the block format uses it (codec zstd, and the last stage of shuffle_zstd): one
compressor and one decompressor per thread, and decompression bounded by the raw size a
header declares, so a forged frame never allocates more than the caller's buffer."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ucm.errors import BlockCorrupt

if TYPE_CHECKING:  # collections.abc.Buffer is new in Python 3.12; annotations only
    from typing_extensions import Buffer

LEVEL = 1

_local = threading.local()


def bound(raw_len: int) -> int:
    """The most bytes a zstd payload of `raw_len` raw bytes may take (above ZSTD_compressBound)."""
    return raw_len + (raw_len >> 7) + 1024


def _compressor() -> Any:
    c = getattr(_local, "zc", None)
    if c is None:
        import zstandard

        c = _local.zc = zstandard.ZstdCompressor(level=LEVEL)
    return c


def _decompressor() -> Any:
    d = getattr(_local, "zd", None)
    if d is None:
        import zstandard

        d = _local.zd = zstandard.ZstdDecompressor()
    return d


def compress(data: Buffer) -> bytes:
    """One zstd frame of `data` (its size in the frame header)."""
    return bytes(_compressor().compress(data))


def decompress(stored: Buffer, raw_len: int) -> bytes:
    """The `raw_len` bytes a zstd frame holds; BlockCorrupt when it declares or decodes to
    another size, or does not decode. Allocates at most `raw_len` bytes (at least 1)."""
    import zstandard

    try:
        # zstandard's stubs name bytes, bytearray and memoryview; it reads any buffer
        declared = zstandard.frame_content_size(stored)  # type: ignore[arg-type]
        if declared >= 0 and declared != raw_len:
            raise BlockCorrupt(f"zstd frame declares {declared} bytes, header {raw_len}")
        raw = _decompressor().decompress(stored, max_output_size=max(raw_len, 1))
    except zstandard.ZstdError as exc:
        raise BlockCorrupt(f"zstd payload does not decode: {exc}") from None
    if len(raw) != raw_len:
        raise BlockCorrupt("decoded payload has the wrong length")
    return bytes(raw)
