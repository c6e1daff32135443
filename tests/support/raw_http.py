"""A request whose body never finishes, as a slow or stalled client sends it (raw bytes over TCP)."""

from __future__ import annotations

import asyncio

HANG_GUARD_S = 60.0  # (not a timing assertion: a server that never answers fails the test here)


async def unfinished_body(port: int, path: str, host: str = "127.0.0.1") -> bytes:
    """POST ``path`` announcing 1,000 bytes, send 10 and stall; what the server answers before closing."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        writer.write(head.encode() + b'{"prompt":')
        await writer.drain()
        return await asyncio.wait_for(reader.read(1 << 16), HANG_GUARD_S)
    finally:
        writer.close()
