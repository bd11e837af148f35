"""Hand-made PDF files for the pipeline tests: zero pages, password-protected (RC4, revision 2).

pypdfium2 cannot save an encrypted PDF, so the encryption dictionary is computed here with the
PDF 1.7 standard security handler, revision 2 (ISO 32000-1, 7.6.3.3 algorithms 2, 3 and 4).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

# the 32-byte padding string of the standard security handler
_PAD = bytes.fromhex("28BF4E5E4E758A4164004E56FFFA01082E2E00B6D0683E802F0CA9FE6453697A")


def rc4(key: bytes, data: bytes) -> bytes:
    s = list(range(256))
    j = 0
    for i in range(256):
        j = (j + s[i] + key[i % len(key)]) % 256
        s[i], s[j] = s[j], s[i]
    out = bytearray()
    i = j = 0
    for byte in data:
        i = (i + 1) % 256
        j = (j + s[i]) % 256
        s[i], s[j] = s[j], s[i]
        out.append(byte ^ s[(s[i] + s[j]) % 256])
    return bytes(out)


def _padded(password: bytes) -> bytes:
    return (password + _PAD)[:32]


def write_pdf(path: Path, objects: list[bytes], trailer_extra: bytes = b"") -> None:
    """A PDF with objects 1..n (object 1 is the catalog) and a correct cross-reference table."""
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for num, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % num + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for off in offsets:
        out += b"%010d 00000 n \n" % off
    out += b"trailer\n<< /Size %d /Root 1 0 R " % (len(objects) + 1) + trailer_extra + b">>\n"
    out += b"startxref\n%d\n%%%%EOF\n" % xref
    Path(path).write_bytes(bytes(out))


def write_zero_page_pdf(path: Path) -> None:
    write_pdf(path, [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [] /Count 0 >>"])


def write_encrypted_pdf(path: Path, user_password: bytes = b"secret", owner_password: bytes = b"owner") -> None:
    """A one-page (blank) PDF that opens only with `user_password` (RC4 40-bit, revision 2)."""
    perms = -4  # every permission
    file_id = hashlib.md5(b"ocria_rt test file").digest()
    o_entry = rc4(hashlib.md5(_padded(owner_password)).digest()[:5], _padded(user_password))
    key = hashlib.md5(_padded(user_password) + o_entry + struct.pack("<i", perms) + file_id).digest()[:5]
    u_entry = rc4(key, _PAD)
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 260] >>",
        b"<< /Filter /Standard /V 1 /R 2 /O <" + o_entry.hex().encode() + b"> /U <"
        + u_entry.hex().encode() + b"> /P %d >>" % perms,
    ]
    fid = file_id.hex().encode()
    write_pdf(path, objects, trailer_extra=b"/Encrypt 4 0 R /ID [<" + fid + b"> <" + fid + b">] ")


def write_huge_png_header(path: Path, width: int = 40000, height: int = 40000) -> None:
    """A PNG whose header declares width x height RGB pixels (the pixel data is a few bytes only)."""
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
                           + chunk(b"IEND", b""))
