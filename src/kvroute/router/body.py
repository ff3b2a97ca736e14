"""Read a request's body: the size limit, and the content encodings the router decodes.

The router's listeners leave bodies as they came (``auto_decompress=False``) and a
``gzip`` or ``deflate`` body is inflated here with its output bounded by the limit:
aiohttp's parser inflates each received chunk as a whole before the size check, so a
1 MB gzip bomb took the router's memory up by 220 MB before its 413. A server that does
inflate (aiohttp's default, a test server started without the option) is read as
before. Any other encoding is 415; a body that is not what its header says, 400 (not a
router error, 500).
"""

from __future__ import annotations

import asyncio
import re
import zlib

import msgspec
from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from kvroute.router.errors import (
    BadRequest,
    ExpectationFailed,
    KvrouteError,
    PayloadTooLarge,
    UnsupportedMediaType,
)

# what aiohttp inflates without optional modules (brotli and zstd need extra packages)
DECODED_ENCODINGS = frozenset({"", "identity", "gzip", "x-gzip", "deflate"})


def decodes(encoding: str) -> bool:
    """Whether a body with this Content-Encoding header is one the router can read."""
    return encoding.strip().lower() in DECODED_ENCODINGS


def unsupported_encoding(encoding: str) -> UnsupportedMediaType:
    return UnsupportedMediaType(
        f"content-encoding {encoding.strip()!r} is not supported: send the body as identity, "
        "gzip or deflate",
        close=True,  # the unread body is still on the connection
    )


def encoding_error(reason: str) -> KvrouteError:
    """The client's error for a body aiohttp's parser could not decode (its ``reason``
    names the encoding): 415 for one it needs a module for, else 400."""
    for name in ("br", "zstd"):
        if f"({name})" in reason:
            return unsupported_encoding(name)
    return BadRequest("the request body does not decode as its content-encoding says", close=True)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, decoded; PayloadTooLarge over ``limit`` bytes (before or after
    decoding), UnsupportedMediaType or BadRequest for an encoding that does not decode."""
    encoding = request.headers.get("Content-Encoding", "")
    if not decodes(encoding):
        raise unsupported_encoding(encoding)
    encoding = encoding.strip().lower()
    length = request.content_length
    if length is not None and length > limit:
        raise PayloadTooLarge(  # closed: aiohttp would read and drop the whole body first
            f"request body of {length} bytes exceeds the {limit}-byte limit", close=True
        )
    await _continue(request)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit") from None
    except (RequestPayloadError, HttpProcessingError):
        what = f"content-encoding {encoding!r}" if encoding else "its headers"
        raise BadRequest(f"the request body is not what {what} says", close=True) from None
    if encoding in ("", "identity") or not raw or request.content.total_compressed_bytes:
        return raw  # plain, or inflated by the server already
    if len(raw) <= ON_LOOP_INFLATE_BYTES:
        return inflate(raw, encoding, limit)
    # the work is the output's, up to 1,000 times the input: off the loop
    return await asyncio.to_thread(inflate, raw, encoding, limit)


# a compressed body this small inflates on the loop: at most about 1,000 times as much
# output (zlib's best ratio), a millisecond; a bigger one in a thread (a 32 KB gzip of
# 32 MiB held the loop 120-270 ms)
ON_LOOP_INFLATE_BYTES = 1024


async def continue_when_read(request: web.Request) -> None:
    """The routes' expect handler: aiohttp's sends "100 Continue" before the handler
    runs, so a client sent its body only to get 401, 413 or 503; ``read_body`` sends it
    once the router is about to read the body (``_continue``)."""


async def _continue(request: web.Request) -> None:
    expect = request.headers.get("Expect")
    if expect is None:
        return
    if expect.strip().lower() != "100-continue":
        raise ExpectationFailed(f"Expect: {expect[:40]!r} is not supported (only 100-continue)")
    if request.version == HttpVersion11:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer's own bytes are still to come


def inflate(data: bytes, encoding: str, limit: int) -> bytes:
    """``data`` decoded from ``encoding`` (gzip or x-gzip, members one after another;
    deflate, zlib-wrapped or raw as aiohttp takes it), never more than ``limit`` + 1
    bytes of output held."""
    if encoding == "deflate":
        wbits = zlib.MAX_WBITS if data[0] & 0x0F == 8 else -zlib.MAX_WBITS
    else:
        wbits = 16 + zlib.MAX_WBITS
    out, rest = bytearray(), data
    while rest:
        inflater = zlib.decompressobj(wbits)
        try:
            out += inflater.decompress(rest, limit + 1 - len(out))
        except zlib.error:
            break
        if len(out) > limit:
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit once decoded")
        if not inflater.eof:
            break
        rest = inflater.unused_data if encoding != "deflate" else b""
    else:
        return bytes(out)
    raise BadRequest(f"the request body is not what content-encoding {encoding!r} says",
                     close=True)  # fmt: skip


# a \uD800-\uDBFF escape without the \uDC00-\uDFFF escape that must follow it
_LONE_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])")


def json_error(what: str, raw: bytes, exc: msgspec.DecodeError | UnicodeDecodeError) -> BadRequest:
    """BadRequest saying why ``raw`` is not JSON. msgspec reports a lone high surrogate
    escape (``"\\ud800"``) as "Input data was truncated", which sends a client looking
    for a cut body: say what it is instead."""
    reason = str(exc)
    if "truncated" in reason and _LONE_HIGH_SURROGATE.search(raw):
        reason = (
            "a \\u escape of a UTF-16 high surrogate (\\ud800-\\udbff) without its low "
            "surrogate: send the text as UTF-8, or escape a pair"
        )
    return BadRequest(f"{what} is not valid JSON: {reason}")
