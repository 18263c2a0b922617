"""How much of a shard server one client may hold: long-poll time and slots.

A long-poll (a pull waiting for a version, a barrier, a wait for every worker to be
done) holds one of the server's handler threads for as long as it waits. Without
bounds, a few dozen pulls for a version that never comes take every thread, and a
status call, a heartbeat or a push then waits behind them. So each long-poll waits at
most `LONG_POLL_CAP_S` whatever deadline its client set (then the client retries), and
takes a slot first (`core.poll_slots`): a worker holds at most `POLLS_PER_WORKER` at
once, and all long-polls together leave a quarter of the pool free for calls that answer
at once. A long-poll over a cap is refused before it waits (RESOURCE_EXHAUSTED) and
changes nothing.

A push is bounded by the shard it goes to (`push_limits`): its bytes, its frames and the
fields of each frame, so that no stream costs a server much more memory than the
largest legal push of that shard. A push over a bound is refused (INVALID_ARGUMENT: the
same bytes would be refused again) and the rest of its stream is not read. A streamed
push must also arrive whole within `max_read_s` (at least `READ_BYTES_PER_S` of its
largest size a second), or it is cancelled; it is read only once its first frame shows
the session of a registered worker, and each worker streams at most `POLLS_PER_WORKER`
pushes at once, on the same slots as long-polls.

A stream's first message must come within `FIRST_MESSAGE_S` (a worker opens its streams
when it has a push to send), and while it has not come the stream holds one of its
caller's `OPENINGS_PER_CALLER` opening slots (the caller: the node its credentials
name), among the few that every caller's opening streams may hold together
(`OPENING_SHARE` of the long-poll slots): idle streams never hold more handler threads
than that, and one caller's never more than its own few. Every caller holds at most
`POLLS_PER_CALLER` long-polls over all its keys, so one caller with a valid credential
takes only its own share of the server. Calls in progress at once are capped
(`max_concurrent_rpcs`), so a flood is refused rather than queued.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.strategies.ps.wire.codec import CHUNK_BYTES

# Long enough that a synchronous step's slowest worker rarely makes a pull retry, short
# enough that a thread is never held for long by a call whose client went away.
LONG_POLL_CAP_S = 30.0
# A worker's pull, plus one prefetch or a retry whose abandoned attempt still waits.
POLLS_PER_WORKER = 2
# A worker sends a stream's first message as it opens it: a few seconds is ample.
FIRST_MESSAGE_S = 5.0
# The share of the long-poll slots that streams waiting for their first message may hold.
OPENING_SHARE = 4
# One caller's streams waiting for their first message: a worker's Step stream and a
# streamed push opened at once, or one of them opened again while the last is let go.
OPENINGS_PER_CALLER = 2
# One caller's long-polls over all its keys (pulls, pushes, steps, waits for all done,
# openings): what a worker holds at its busiest (a step stream, a streamed push, a pull
# and a barrier, each with one retry whose abandoned attempt still waits), and no more.
POLLS_PER_CALLER = 4 * POLLS_PER_WORKER
# A Step stream may be answered ROLLED_BACK this many times in a row before a push
# passes the session check (a worker registers again after the first).
MAX_UNVERIFIED_PUSHES = 4


# A frame of a push holds ~16 header fields, one per tensor slice of the layout and a few
# of payload metadata; this leaves ample room without letting tiny fields pile up.
FIELDS_PER_FRAME = 64
# Payload bytes per push, as a multiple of the largest legal payload: a push of a wider
# dtype than the shard's (twice as wide) still reaches the header check, which names it.
BYTES_SLACK = 2
# Frames per push, as a multiple of what the shard's largest push needs in CHUNK_BYTES
# pieces: room for a client that cuts smaller chunks, but not one of a byte a frame.
FRAME_SLACK = 4
# A streamed push arrives at this rate or faster (a slow link's), and within at least
# MIN_READ_S: a client that trickles bytes holds a handler thread no longer than that.
READ_BYTES_PER_S = 1 << 20
MIN_READ_S = 30.0


@dataclass(frozen=True)
class PushLimits:
    """Bounds on one push to a shard: payload bytes, frames, fields of each frame, and
    seconds to read a streamed one."""

    max_bytes: int
    max_frames: int
    max_fields: int
    max_read_s: float


def push_limits(dense_nbytes: int, compressed_nbytes: int | None, num_slices: int) -> PushLimits:
    """The bounds on a push to a shard whose raw gradient has `dense_nbytes`, whose
    compressed one (if the run compresses) `compressed_nbytes`, and which holds
    `num_slices` tensor slices. Either payload is framed in CHUNK_BYTES pieces."""
    max_bytes = BYTES_SLACK * max(dense_nbytes, compressed_nbytes or 0)
    frames_needed = max(1, -(-max_bytes // CHUNK_BYTES))
    return PushLimits(max_bytes, FRAME_SLACK * frames_needed + FRAME_SLACK,
                      FIELDS_PER_FRAME + 2 * num_slices, max(MIN_READ_S, max_bytes / READ_BYTES_PER_S))


def long_poll_wait_s(remaining_s: float | None, cap_s: float = LONG_POLL_CAP_S) -> float:
    """How long a long-poll may wait: the client's remaining deadline, at most `cap_s`
    (gRPC reports a call without deadline as one with a huge remaining time; None too)."""
    if remaining_s is None:
        return cap_s
    return max(0.0, min(remaining_s, cap_s))


def opening_slots(max_polls: int) -> int:
    """Streams that may wait for their first message at once, of `max_polls` long-poll slots."""
    return max(2, max_polls // OPENING_SHARE)


def max_concurrent_rpcs(max_threads: int) -> int:
    """Calls in progress or queued at once on a shard of `max_threads` handler threads:
    every thread busy and as many calls again waiting for one."""
    return 2 * max_threads
