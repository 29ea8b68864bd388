"""Checks on a raw HTTP/1.1 request head that h11 does not make, for the servers that parse HTTP with it (the sandbox
service under uvicorn, the agent endpoint).

h11 frames a request that carries both ``Content-Length`` and ``Transfer-Encoding: chunked`` by the chunked body and
keeps the connection open, and it unfolds obs-fold lines. A proxy in front that reads the same bytes another way
(by the length, or not seeing a folded ``Transfer-Encoding``) then forwards what follows the 0-chunk as a request of
its own: request smuggling. RFC 9112 6.1 says such a message is refused or its connection closed after the answer;
both servers refuse it with 400 and close. Standard library only.
"""

from __future__ import annotations

import re

__all__ = ["request_head", "framing_problem", "framed_two_ways", "MAX_HEAD_BYTES"]

MAX_HEAD_BYTES = 64 * 1024
"""A head not complete within this many bytes is not looked for further (the parser refuses it by its own limit)."""

_BLANK_LINE = re.compile(rb"\r?\n\r?\n")
_LINE = re.compile(rb"\r?\n")


def request_head(buffer: bytes) -> bytes | None:
    """The request head (request line and header lines, without the blank line) at the start of ``buffer`` once it
    has arrived whole; None while it has not. Empty lines before the request line are skipped, as parsers do."""
    data = buffer[:MAX_HEAD_BYTES].lstrip(b"\r\n")
    end = _BLANK_LINE.search(data)
    return None if end is None else data[: end.start()]


def framing_problem(head: bytes) -> str | None:
    """Why a request with this head must be refused (and its connection closed), or None when its framing is plain.

    Refused: a header line folded onto the one before it (obs-fold, a line starting with a space or a tab: RFC 9112
    5.2), and ``Content-Length`` together with ``Transfer-Encoding`` in any spelling, order or case (RFC 9112 6.1).
    """
    lines = _LINE.split(head)[1:]
    names = set()
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            return "a header line folded onto the previous one (obs-fold) is refused; send each header on one line"
        names.add(line.partition(b":")[0].strip().lower())
    return framed_two_ways(names)


def framed_two_ways(names: set[bytes]) -> str | None:
    """Why a request whose lower-case header names are ``names`` must be refused for carrying both ``Content-Length``
    and ``Transfer-Encoding`` (RFC 9112 6.1), or None."""
    if b"content-length" in names and b"transfer-encoding" in names:
        return "a request with both Content-Length and Transfer-Encoding is refused (RFC 9112 6.1): send one of them"
    return None
