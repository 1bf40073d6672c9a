"""Sockets and links: asyncio transport and channels, handshake guard, paced and shaped links,
retries."""
