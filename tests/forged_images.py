"""Image headers that lie about their size: what a decompression bomb sends. A decoder that
believed them would allocate width x height x 3 bytes."""

from __future__ import annotations

import struct
import zlib


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header(width: int, height: int, idat: bytes = b"") -> bytes:
    """A PNG claiming width x height RGB pixels: signature, IHDR, one IDAT holding `idat`, IEND
    (57 bytes with the default empty IDAT)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def jpeg_header(width: int, height: int) -> bytes:
    """A JPEG's start, frame header (SOF0, 3 components) and scan header claiming width x height."""
    frame = struct.pack(">BHHB", 8, height, width, 3) + bytes([1, 0x22, 0, 2, 0x11, 1, 3, 0x11, 1])
    scan = bytes([3, 1, 0, 2, 0x11, 3, 0x11, 0, 0x3F, 0])
    return (b"\xff\xd8" + b"\xff\xc0" + struct.pack(">H", len(frame) + 2) + frame
            + b"\xff\xda" + struct.pack(">H", len(scan) + 2) + scan + b"\x00" * 16)
