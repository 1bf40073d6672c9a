"""Exactly once, across a lost reply and across a resumed global server: which exchanges of a
group the global server merged (``Merged``), and what a group process sent that a resumed server
may lack (``Unsaved``). Numpy, sans-IO; ``exchange.py`` holds the exchange itself.

Exactly once. Each exchange carries ``session`` (random, one per group server process) and
``seq`` (1, 2, ... within the session) in its counters. The global server remembers the last
seq it merged of each of a group's sessions for the run's lifetime (``Merged``, at most
``MAX_SESSIONS``: past it a new session is refused) and answers an exchange whose seq is not
above it, a repeat or an older one replayed, without merging again. When the reply is lost
(``ConnectionError``) the exchange stays *pending*: the next attempt sends the very same ``s``
and counters under the same seq, so whether or not the first copy was merged, ``s`` lands once.
Down, values to set are idempotent, so a lost reply does no harm either: a group starts a new seq
only after the reply to the last one, so the indices sent since the last new seq
(``GroupMirror.unacked``) are the only ones the group may lack; the answer to a repeat sends them
again with their current values, together with the new top-k (after a dense answer that may have
been lost, the answer to the repeat is dense again). Either way the group's copy equals ``known``
bit for bit afterwards (copies, no arithmetic). Newer pushes go out with the exchange after that.

Resume. The global server's checkpoint holds, per group, the (session, seq) of the last exchange
merged into it, so a server resumed from it lacks the exchanges it merged after it. Each reply to
an exchange names that seq for the server's last two snapshots (``saved_exchanges``), and the
GLOBAL_WEIGHTS that answer a group's PULL name the server's current last merged exchange
(``last_exchange``). A `minips group` process keeps, in its ``Unsaved``, what it sent after
each: on reconnecting it compares, and a server resumed from a checkpoint at seq ``c`` lacks
exactly the exchanges after ``c`` that it had merged; the group sends their sum (deltas and
samples) once more, inside its next exchange. Memory stays bounded: ``after[s]`` is the sum of the
exchanges completed with seq > s, and only three seqs are kept, the last one completed and the two
the last reply named. That is enough: the server writes one snapshot at a time and takes the next
only once the previous write is done, so its checkpoint file is one of its last two snapshots; a
snapshot taken after the merge that the last reply answered holds the last completed seq (or the
pending one, whose resend is then answered as a repeat), and one taken before it was among the
last two that reply named.

Invariants: for each seq ``s`` in ``Unsaved.after``, ``after[s]`` is the sum of the completed
exchanges with seq > s that the global server's state may lack if it is rolled back to ``s``.
``Merged`` never forgets a session it holds (past ``MAX_SESSIONS`` a new one is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from minips.sparse import SparseVector, add_into

__all__ = ["MAX_SESSIONS", "Merged", "Tally", "Unsaved", "lost", "seqs_in"]


# -- exactly once, the global server's half: the last seq merged of each session -------------

MAX_SESSIONS = 4096  # sessions per group whose last merged seq is kept for the run's lifetime:
# one per group process run (restarts, replacements), a few in a run; 4096 pairs are ~64 KiB in a
# checkpoint. Past it a session the group never had is refused, never forgotten: a replay of a
# forgotten session would be merged twice


class Merged:
    """The last seq merged of every session of one group (at most ``MAX_SESSIONS``), kept for
    the run's lifetime (and in its checkpoints): a replay is never merged twice, however many
    sessions came between."""

    def __init__(self, pairs: list[list[int]] | None = None) -> None:
        self.last: dict[int, int] = {}  # session -> last merged seq, merged longest ago first
        for session, seq in pairs or []:
            self.note(int(session), int(seq))

    def holds(self, session: int, seq: int) -> bool:
        """Exchange (``session``, ``seq``) is merged already, or older than one that is."""
        return seq <= self.last.get(session, -1)

    def full(self, session: int) -> bool:
        """``session`` is new and the record holds ``MAX_SESSIONS`` already: it may not merge
        (its first exchange is refused, ERROR ``invalid``; the run's earlier sessions stay)."""
        return session not in self.last and len(self.last) >= MAX_SESSIONS

    def note(self, session: int, seq: int) -> None:
        """Exchange (``session``, ``seq``) is merged now."""
        self.last.pop(session, None)
        self.last[session] = seq

    def pairs(self) -> list[list[int]]:
        """[session, seq] of each session, merged longest ago first (for a checkpoint)."""
        return [[s, q] for s, q in self.last.items()]


# -- resume, the group process's half: what a resumed server may lack ------------------------

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

    def merged(self, seq: int, delta: np.ndarray | SparseVector, samples: int,
               saved: list[int]) -> None:
        """Exchange ``seq`` (which sent ``delta``, dense or sparse) got its reply, which named
        ``saved``: this session's seqs in the server's last two snapshots."""
        for s, tally in self.after.items():
            if s < seq:  # a repeat whose first copy a snapshot holds adds nothing to it
                add_into(tally.delta, delta)
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


def lost(unsaved: Unsaved | None, held: int, pending: int | None, replied: bool,
         n: int) -> Tally | None:
    """What a global server that holds a group session's exchanges up to seq ``held`` lacks of
    them (the group sends it again with its next exchange): what ``unsaved`` recorded
    (``pending``: the seq whose reply was lost, if any); nothing when no exchange of the session
    got its reply yet (``replied``); None when no record can say (the replies so far named no
    snapshot: an older global server), and that work stays lost."""
    if unsaved is not None:
        return unsaved.restore(held, pending)
    return None if replied else Tally.zero(n)


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
