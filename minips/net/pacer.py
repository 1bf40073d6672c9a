"""Reading a socket no faster than a link: the downlink half of a paced channel.

``ReadPacer`` charges every read of a ``FrameProtocol`` to a ``links.TokenBucket``. While the
bucket is in debt it *holds*: the protocol pauses reading (bytes wait in the socket's receive
buffer, then the peer's TCP waits, as behind a slow link) and keeps complete messages from ``recv``
until their bytes' time has passed. Reads are cut to one chunk of the bucket (about 10 ms of the
rate), so a large frame arrives at an even pace instead of in one socket read and one long pause.
The uplink half (paced writes) is ``Channel._send_paced`` in ``channel.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from minips.net.links import TokenBucket

__all__ = ["ReadPacer"]


class ReadPacer:
    """Holds reading while ``bucket`` is in debt; calls ``changed()`` when ``hold`` flips."""

    def __init__(self, bucket: TokenBucket, loop: asyncio.AbstractEventLoop,
                 changed: Callable[[], None]) -> None:
        self.bucket, self.loop, self.changed = bucket, loop, changed
        self.hold = False  # reading paused and messages kept until the debt is repaid

    def chunked(self, get_buffer: Callable[[int], memoryview]) -> Callable[[int], memoryview]:
        """``get_buffer`` handing the socket at most one chunk of the bucket per read."""
        chunk = self.bucket.chunk()
        return lambda hint: get_buffer(hint)[:chunk]

    def charge(self, nbytes: int) -> None:
        """A read of ``nbytes``: hold until the bucket has paid for it."""
        wait = self.bucket.take(nbytes, self.loop.time())
        if wait > 0 and not self.hold:
            self.hold = True
            self.changed()
            self.loop.call_later(wait, self._release)

    def _release(self) -> None:
        wait = self.bucket.take(0, self.loop.time())
        if wait > 0:  # a read under way when reading paused added to the debt
            self.loop.call_later(wait, self._release)
            return
        self.hold = False
        self.changed()

    def stop(self) -> None:
        """The connection closed: hold nothing back (a pending release changes nothing)."""
        self.hold = False
