"""The aux payload: one request's rows of an engine's host metadata buffers, moved as bytes with the last part.

An engine that keeps per-request metadata in host buffers (SGLang's `MetadataBuffers`: one row per
request slot with the first output token, cached-token counts, logprobs, hidden state, the bootstrap
room) has kvbroker move them as the aux bytes of the last part; the receiving side writes them into
its own row before it reports the request done.

    encode_aux(ptrs, item_lens, index) -> bytes        prefill: the rows at `index`, read from memory
    decode_aux(payload) -> list[bytes]                  the rows, validated
    write_aux(rows, ptrs, item_lens, index)             decode: into its rows at `index`

Wire format (little endian): b"KVBA", version u8, count u16, count × row length u32, the rows.
Rows pair up by position, as upstream pairs aux buffers; a peer with more buffers has its extra
rows ignored (an engine may check the buffer counts at registration, as SGLang does).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence

MAGIC = b"KVBA"
VERSION = 1
_HEADER = struct.Struct("<4sBH")
_LEN = struct.Struct("<I")


class AuxError(ValueError):
    """A payload that is not an aux payload of this version, or rows that do not fit the buffers."""


def encode_aux(ptrs: Sequence[int], item_lens: Sequence[int], index: int) -> bytes:
    if len(ptrs) != len(item_lens):
        raise AuxError(f"{len(ptrs)} aux buffers but {len(item_lens)} item lengths")
    if index < 0:
        raise AuxError(f"aux index {index} is negative")
    rows = [ctypes.string_at(int(p) + int(n) * index, int(n)) for p, n in zip(ptrs, item_lens)]
    return b"".join([_HEADER.pack(MAGIC, VERSION, len(rows)), *(_LEN.pack(len(r)) for r in rows), *rows])


def decode_aux(payload: bytes) -> list[bytes]:
    if len(payload) < _HEADER.size:
        raise AuxError(f"aux payload of {len(payload)} bytes is shorter than its header")
    magic, version, count = _HEADER.unpack_from(payload)
    if magic != MAGIC or version != VERSION:
        raise AuxError(f"aux payload starts {payload[:5]!r}, not {MAGIC!r} version {VERSION}")
    lengths_end = _HEADER.size + count * _LEN.size
    if len(payload) < lengths_end:
        raise AuxError(f"aux payload of {len(payload)} bytes cuts its {count} row lengths short")
    lengths = [_LEN.unpack_from(payload, _HEADER.size + i * _LEN.size)[0] for i in range(count)]
    if lengths_end + sum(lengths) != len(payload):
        raise AuxError(f"aux payload holds {len(payload) - lengths_end} row bytes, its header says {sum(lengths)}")
    rows, at = [], lengths_end
    for n in lengths:
        rows.append(payload[at:at + n])
        at += n
    return rows


def write_aux(rows: Sequence[bytes], ptrs: Sequence[int], item_lens: Sequence[int], index: int) -> int:
    """Write rows into the buffers' row `index`; returns how many were written (the shorter list)."""
    count = min(len(rows), len(ptrs))
    for i in range(count):
        if len(rows[i]) != int(item_lens[i]):
            raise AuxError(f"aux row {i} is {len(rows[i])} bytes, this side's buffer rows are {item_lens[i]}")
    for i in range(count):
        ctypes.memmove(int(ptrs[i]) + int(item_lens[i]) * index, rows[i], len(rows[i]))
    return count
