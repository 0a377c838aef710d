"""The serve benches' own HTTP/1.1 client: one keep-alive connection, spoken by hand, its body read piece by piece
as it arrives. A bench times the server: an HTTP library's own work for each request and chunk (httpx's is
Python, on a client process's one event loop shared by its clients) would be counted as the server's latency."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class Connection:
    """One client's connection to a plain ``http://`` server; reopened by the next request after it ends."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"bench serve drives a plain http:// server, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.authority = parts.netloc
        self.prefix = parts.path.rstrip("/")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> int:
        """Send a request (on a new connection if the last one ended) and read its status line and headers;
        the status. ``body()`` then yields the response's body."""
        if self._writer is None or self._reader.at_eof() or self._writer.is_closing():
            await self.close()
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        lines = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.authority}",
                 f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
        self._writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        head = (await self._reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        self._headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
        return status

    async def body(self) -> AsyncIterator[bytes]:
        """The body of the response just read, piece by piece as it arrives (chunked or of a known length); a
        body the server cut off raises (``asyncio.IncompleteReadError`` or ``ConnectionError``)."""
        reader, headers = self._reader, self._headers
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")  # no trailers are sent
                    break
                yield await reader.readexactly(size)
                await reader.readexactly(2)
        elif "content-length" in headers:
            left = int(headers["content-length"])
            while left:
                piece = await reader.read(min(left, 1 << 16))
                if not piece:
                    raise ConnectionError("the server closed the connection before the body's end")
                left -= len(piece)
                yield piece
        if headers.get("connection", "").lower() == "close":
            await self.close()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._reader = self._writer = None
