"""A `minips group` process's record of the work the global server may hold only in memory, so
that a global server resumed from its checkpoint gets it again, exactly once (numpy, sans-IO).

The global server's checkpoint holds, per group, the (session, seq) of the last exchange merged
into it. Each reply to an exchange names that seq for the server's last two snapshots
(``saved_exchanges``), and the WEIGHTS that answer a PULL name the server's current last merged
exchange (``last_exchange``). On reconnecting, a group compares that with what it sent: a server
resumed from a checkpoint at seq ``c`` lacks exactly the exchanges after ``c`` that it had merged,
and the group sends their sum (deltas and samples) once more, inside its next exchange.

Bounded memory. ``after[s]`` is the sum of the exchanges completed with seq > s; only three seqs
are kept: the last one completed and the two the last reply named. That is enough: the server
writes one snapshot at a time and takes the next only once the previous write is done, so its
checkpoint file is one of its last two snapshots; a snapshot taken after the merge that the last
reply answered holds the last completed seq (or the pending one, whose resend is then answered as
a repeat), and one taken before it was among the last two that reply named.

Invariant: for each seq ``s`` in ``after``, ``after[s]`` is the sum of the completed exchanges
with seq > s that the global server's state may lack if it is rolled back to ``s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from minips.sparse import SparseGrad, scatter_add

__all__ = ["Tally", "Unsaved", "seqs_in"]


@dataclass
class Tally:
    """What some exchanges sent, summed: the deltas and the samples they counted."""

    delta: np.ndarray  # (n,) float32
    samples: int = 0

    @classmethod
    def zero(cls, n: int) -> Tally:
        return cls(np.zeros(n, np.float32))


class Unsaved:
    """The exchanges of one group session that the global server's checkpoint may lack."""

    def __init__(self, n: int, start: int = 0) -> None:
        self.n = n
        self.after: dict[int, Tally] = {start: Tally.zero(n)}  # seq -> what completed after it

    def merged(self, seq: int, delta: np.ndarray | SparseGrad, samples: int,
               saved: list[int]) -> None:
        """Exchange ``seq`` (which sent ``delta``, dense or sparse) got its reply, which named
        ``saved``: this session's seqs in the server's last two snapshots."""
        for s, tally in self.after.items():
            if s < seq:  # a repeat whose first copy a snapshot holds adds nothing to it
                scatter_add(tally.delta, delta)
                tally.samples += samples
        self.after.setdefault(seq, Tally.zero(self.n))
        keep = {seq, *saved}
        self.after = {s: t for s, t in self.after.items() if s in keep}

    def restore(self, c: int, pending: int | None) -> Tally | None:
        """The server holds this session's exchanges up to seq ``c`` now (0: none): return what
        to send again, or None when this record cannot say (the work after ``c`` stays lost)."""
        if c in self.after:
            replay = self.after[c]
        elif c == pending:  # the exchange whose reply was lost is in the checkpoint
            replay = Tally.zero(self.n)
        else:
            self.after = {c: Tally.zero(self.n)}
            return None
        # seqs above c are gone from the server's history; below it, the replay is sent anew
        self.after = {s: Tally(t.delta - replay.delta, t.samples - replay.samples)
                      for s, t in self.after.items() if s < c}
        self.after[c] = Tally.zero(self.n)
        return replay


def seqs_in(info: dict[str, Any], key: str, session: int) -> list[int] | None:
    """The seqs of ``session`` that ``info[key]`` names (a [session, seq] pair or a list of
    them): 0 for a pair of another session or none; None when the server did not say (an older
    global server) or said something malformed."""
    value = info.get(key)
    pairs = [value] if isinstance(value, list) and value and type(value[0]) is int else value
    if not isinstance(pairs, list) or not pairs or not all(
            isinstance(p, list) and len(p) == 2 and all(type(v) is int for v in p)
            for p in pairs):
        return None
    return [q if s == session and q >= 0 else 0 for s, q in pairs]
