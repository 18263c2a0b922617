"""Pull compression: a shard's broadcast copy, the parameters every worker holds exactly.

After each new version the shard compresses the change `delta = w - w_b` of its
parameters `w` against the broadcast copy `w_b`, and adds what the payload decodes to
into `w_b` itself, as every worker adds it into its own copy: both decode the same bytes
with the same operations, so a worker that received every change in order holds `w_b`
bit for bit. What the payload left out stays in `w - w_b` and goes out with later
changes: error feedback at the server, one residual per shard (not per worker), with no
state of its own (it is `w - w_b`).

The bound: right after a version, `w - w_b` is what compressing `delta` left out. For
`topk`, whose payload keeps the k largest magnitudes of n, `|w - w_b|_2 <= c |delta|_2`
with `c = sqrt(1 - k/n)`, and `delta` is the previous residual plus the step's update,
so the residual never exceeds `c / (1 - c)` times the largest update. For `quantization`
each element is off by at most half a level (`(max - min) / 510` of `delta`). Every
`dense_every` versions `w_b` is reset to `w` (sent dense): the copies are then equal.

Workers at different versions (async and SSP): the copy keeps the changes of its
latest versions since the last reset (`recent`), as many as take no more bytes together
than the copy dense. A worker holding version `u` of the copy is answered at version `v`
with the changes of `u+1 .. v`, one after another, and adds them in that order, as the
copy did: it then holds `w_b` at `v` bit for bit, and so is within the bound above of
the shard's parameters at `v`, the same bound as in sync mode, however far behind it
was. A worker further behind than `recent` reaches (or across a reset) is answered
`w_b` dense: the catch-up never costs more bytes than a dense answer, and the shard
keeps at most one copy's worth of changes besides the copy, whatever the number of
workers (not a reference copy per worker).

Every answer a shard gives under pull compression, dense or not, is its broadcast copy
at its version: a worker that registered anew, missed a version or pulls through shared
memory receives `w_b` dense, and is again in step with the others.

Pure bookkeeping: no lock (the shard's is held), no transport.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from disttrain.strategies.ps.wire.payloads import ParameterChanges

logger = logging.getLogger(__name__)


class BroadcastCopy:
    """The broadcast copy of one shard's parameters and the changes of its latest versions.

    Args:
        initial: the shard's flat parameters now (copied).
        changes: how a change is written and added (the shard's plan and scheme).
        dense_every: reset the copy to the parameters at every multiple of this version.
        version: the shard's version now.
    """

    def __init__(self, initial: torch.Tensor, changes: ParameterChanges, dense_every: int, version: int = 0):
        if dense_every < 1:
            raise ValueError(f"compression.pull_dense_every is {dense_every}; it must be >= 1")
        self.copy = initial.detach().reshape(-1).clone()
        self.changes = changes
        self.dense_every = dense_every
        self.version = version
        # The most changes a catch-up carries: more would take more bytes than the copy
        # dense (a change never takes more: its segments go dense where topk would).
        dense_nbytes = self.copy.numel() * self.copy.element_size()
        self.capacity = max(1, dense_nbytes // max(changes.nbytes, 1))
        # The payloads that led to versions version - len + 1 .. version, oldest first.
        self.recent: deque[bytes] = deque(maxlen=self.capacity)
        self._scratch = torch.empty_like(self.copy)

    @property
    def change(self) -> bytes | None:
        """The payload that led from version - 1 to version (None: the copy was reset)."""
        return self.recent[-1] if self.recent else None

    @property
    def nbytes_kept(self) -> int:
        """Bytes the kept changes take (at most the copy's own, dense)."""
        return sum(len(data) for data in self.recent)

    def advance(self, parameters: torch.Tensor, version: int) -> None:
        """The shard reached `version` with `parameters`: compress their change into the
        copy (or reset it, at a dense version or when a version was skipped)."""
        if version != self.version + 1 or version % self.dense_every == 0:
            self.reset(parameters, version)
            return
        data = self.changes.encode(parameters.detach().reshape(-1) - self.copy)
        assert len(data) == self.changes.nbytes, "a pulled change has a fixed length"
        self.changes.add(self.copy, data, self._scratch)
        self.version = version
        self.recent.append(data)

    def reset(self, parameters: torch.Tensor, version: int) -> None:
        """The copy becomes the parameters at `version`: the next answer goes dense."""
        self.copy.copy_(parameters.detach().reshape(-1))
        self.version = version
        self.recent.clear()

    def change_for(self, holds_version: int, version: int) -> bytes | None:
        """The payload that brings a worker holding the copy at `holds_version` to
        `version`: the changes of the versions between, oldest first (see
        `ParameterChanges.add_all`); None when it needs the copy dense (it holds a
        version the kept changes do not start from, a newer one, or none).
        """
        behind = version - holds_version
        if version != self.version or holds_version < 0 or not 1 <= behind <= len(self.recent):
            return None
        if behind == 1:
            return self.recent[-1]
        return b"".join(list(self.recent)[-behind:])
