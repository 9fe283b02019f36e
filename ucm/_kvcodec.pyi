# The types of ucm._kvcodec, the C extension built from native/kvcodec.c (mypy cannot read a .so).
from typing import Any, TypeAlias

import numpy as np
from typing_extensions import Buffer

IMPL: str  # the loops this CPU runs: "avx2" or "portable"
HASHES: int  # 1 when dequantize_block returns the payload's xxh3-64 (built with xxhash.h)

# numpy's stubs give ndarray the buffer protocol (__buffer__) only from Python 3.12
_Piece: TypeAlias = Buffer | np.ndarray[Any, Any]
_Out: TypeAlias = _Piece | list[_Piece] | tuple[_Piece, ...]  # pieces filled in order

def dequantize_block(out: _Out, payload: Buffer, plan: Buffer, bits: int, dtype: int,
                     /) -> int | None: ...
def dequantize_block_portable(out: _Out, payload: Buffer, plan: Buffer, bits: int, dtype: int,
                              /) -> int | None: ...
def quantize_block(payload: Buffer, raw: Buffer, plan: Buffer, bits: int, dtype: int, /) -> int: ...
def quantize_block_portable(payload: Buffer, raw: Buffer, plan: Buffer, bits: int, dtype: int,
                            /) -> int: ...
