"""One shard's server as a worker reaches it: the channel, the worker's registration and
session, and its payload calls (pushes, pulls and steps: a push and the parameters it
leads to in one round trip), their bytes through gRPC messages or, once the shard offered
them and they map from here (same machine), the shard's shared-memory segments.

Every call carries a deadline and is retried while it fails transiently (`retry`). A
call refused for its session (or its worker id unknown), by a server that restarted since
this worker registered, is made again after registering anew (again after each further
restart, a few times).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
import torch

from disttrain.compression import InvalidPayload
from disttrain.core.channels import open_channel
from disttrain.core.errors import DistributedError
from disttrain.core.tls import TlsFiles
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps.wire import service
from disttrain.strategies.ps.wire.codec import Frame, Payload, copy_chunks, decode_chunks, decode_tensor
from disttrain.strategies.ps.wire.payloads import ParameterChanges
from disttrain.strategies.ps.wire.sharding import ShardPlan
from disttrain.strategies.ps.wire.shared_memory import SegmentPair, SharedMemoryUnavailable
from disttrain.strategies.ps.worker.overlap import Written
from disttrain.strategies.ps.worker.retry import ReplyLost, RetryPolicy, describe, with_retries
from disttrain.strategies.ps.worker.step_stream import StepStream

logger = logging.getLogger(__name__)

ROLLED_BACK = pb.PushReply.Outcome.Value("ROLLED_BACK")
MAX_RENEWALS = 5  # registrations anew within one call, each after another restart of its server
# refusals a restarted server gives a worker registered with an earlier incarnation of it
RENEWABLE = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION)


class ShardClient:
    """Calls to one shard's server at `address`. Payload bytes travel in the gRPC
    messages, or through shared memory once `segments` are attached (same machine). Every
    call carries `token` when given (a server started with one refuses calls without it),
    over TLS when `tls` is enabled.
    """

    def __init__(self, address: str, shard: int, policy: RetryPolicy, token: str | None = None,
                 tls: TlsFiles | None = None):
        self.address = address
        self.shard = shard
        self.policy = policy
        self.segments: SegmentPair | None = None
        # The server's incarnation as last heard: another one means it restarted.
        self.incarnation = 0
        # The run's step of the parameters last landed (`sync_step` of the answer; 0 in
        # ssp and async mode), whether the shard answered as restored and not stepped
        # since (`restored`: its step may lag for good), and how many times this shard
        # was found restarted.
        self.sync_step = 0
        self.restored = False
        # How many epochs this worker has trained to their end, and the step its latest
        # push of a step was computed on: told again with every registration (a restored
        # shard may have lost the pushes that said it).
        self.epochs_done = 0
        self.pushing_step = 0
        self.num_restarts_seen = 0
        self.session = b""  # this worker's session on the shard, from its registration
        self._joined: tuple | None = None
        self.drop_replies = 0  # replies of pushes to lose on purpose (fault injection)
        # The shard's buffers (float64) of the newest parameters landed, None before any
        # or when it holds none; replaced whole, for the worker's thread to read.
        self.buffers: torch.Tensor | None = None
        # Pull compression: how the shard writes a change (None: the run pulls dense), and
        # 1 + the version of the shard's parameters `into` holds as last landed (0: none
        # since registering); every answer is the shard's broadcast copy, so a change
        # applies exactly when it starts from that version.
        self.changes: ParameterChanges | None = None
        self.holds_version = 0
        self._scratch: torch.Tensor | None = None
        self._join_lock = threading.Lock()
        # under the run's CA, only shard S's certificate (node server<S>) or the operator's serves
        self.channel = open_channel(address, tls, token, options=service.CHANNEL_OPTIONS, role="server",
                                    node_id=f"server{shard}")
        self._calls = {}
        for name, (kind, request_type, response_type) in service.METHODS.items():
            serialize = service.identity if request_type is None else request_type.SerializeToString
            deserialize = service.read_parameters if response_type is None else response_type.FromString
            self._calls[name] = getattr(self.channel, kind)(
                service.method_path(name), request_serializer=serialize, response_deserializer=deserialize)
        self.stream = StepStream(lambda requests: self._calls["Step"](requests, wait_for_ready=True))

    def _retry(self, what: str, fn: Callable[[], object], renewals: int = MAX_RENEWALS,
               policy: RetryPolicy | None = None):
        """`fn` until it answers (see `retry.with_retries`; `policy`: another than the
        shard's). A call refused for its session, or for naming a worker the server does
        not know, by a server that restarted since this worker registered (from a
        checkpoint, or from nothing), is made again after registering anew: again each
        time the server restarted once more meanwhile (a long wait, at a barrier, may
        span two restarts of a shard killed again before its next checkpoint),
        `renewals` times at most.

        Raises:
            DistributedError: the call failed for good (its status code and message named).
        """
        session = self.session
        try:
            return with_retries(policy or self.policy, f"{what} on {self.address}", fn)
        except grpc.RpcError as e:
            if renewals > 0 and e.code() in RENEWABLE and self._renew(session):
                return self._retry(what, fn, renewals - 1, policy=policy)
            raise DistributedError(f"{what} on shard {self.shard} at {self.address} failed: "
                                   f"{describe(e)}") from e

    def _renew(self, refused: bytes) -> bool:
        """After a call was refused for carrying session `refused`: whether registering
        again may help (the session changed meanwhile, or the server restarted), having
        registered again; False when another process has taken this worker's id."""
        if self._joined is None:
            return False
        if self.session != refused:
            return True
        status = self._retry("GetStatus", lambda: self._calls["GetStatus"](
            pb.StatusRequest(), timeout=self.policy.timeout_s, wait_for_ready=True), renewals=0)
        if status.incarnation == self.incarnation:
            return False
        self.rejoin(status.incarnation)
        return True

    def _stamped(self, request):
        """`request` with this worker's session, when its kind carries one, and its id
        where the request names none (a copy: one request may go to every shard at once)."""
        if "session" not in request.DESCRIPTOR.fields_by_name:
            return request
        stamped = type(request)()
        stamped.CopyFrom(request)
        stamped.session = self.session
        if not stamped.worker_id and self._joined is not None:
            stamped.worker_id = self._joined[0].worker_id
        return stamped

    def unary(self, name: str, request, timeout_s: float | None = None):
        timeout = self.policy.timeout_s if timeout_s is None else timeout_s
        return self._retry(name, lambda: self._calls[name](self._stamped(request), timeout=timeout,
                                                           wait_for_ready=True))

    def join(self, request: pb.RegisterRequest, plan: ShardPlan, num_shards: int, memory_required: bool
             ) -> pb.WorkerAssignment:
        """Register with this shard and map its shared memory when offered; kept, so a
        restarted server is joined again the same way (`rejoin`).

        Raises:
            DistributedError: the server holds another shard or model than `plan`.
        """
        stamped = pb.RegisterRequest()
        stamped.CopyFrom(request)
        stamped.epochs_done, stamped.sync_step = self.epochs_done, self.pushing_step
        assignment = self.unary("RegisterWorker", stamped)
        if assignment.num_shards != num_shards or assignment.shard != self.shard:
            raise DistributedError(f"server {self.address} holds shard {assignment.shard}/"
                                   f"{assignment.num_shards}, but it was given as shard "
                                   f"{self.shard}/{num_shards}; list servers in shard order")
        if service.plan_layout(assignment.layout) != plan.slices or assignment.dtype != plan.dtype:
            raise DistributedError(f"server {self.address} holds a different model than this "
                                   "worker; start servers and workers with the same config")
        self.segments = None
        if assignment.HasField("shared_memory"):
            self.attach(assignment.shared_memory, plan, memory_required)
        elif memory_required:
            raise DistributedError(f"server {self.address} offered no shared memory; use "
                                   "ps.payload_transport: auto or grpc")
        self.incarnation, self.session = assignment.incarnation, assignment.session
        self.holds_version = 0  # a restarted shard's copy is another: the next answer goes dense
        self._joined = (pb.RegisterRequest(), plan, num_shards, memory_required)
        self._joined[0].CopyFrom(request)
        self._joined[0].requested_rank = assignment.rank
        return assignment

    def rejoin(self, incarnation: int) -> None:
        """Register again with a server that restarted as `incarnation` (it makes new
        shared-memory segments); once, however many calls noticed the restart."""
        with self._join_lock:
            if self.incarnation != incarnation:
                logger.warning("shard %d at %s restarted; registering with it again", self.shard,
                               self.address)
                self.join(*self._joined)
                self.num_restarts_seen += 1

    def check_restart(self, timeout_s: float) -> None:
        """Register again if the server restarted since this worker last heard from it
        (one status call, not retried: an unreachable server is left to the next check or
        the next call)."""
        if self._joined is None:
            return
        try:
            status = self._calls["GetStatus"](pb.StatusRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return
        if status.incarnation not in (0, self.incarnation):
            try:
                self.rejoin(status.incarnation)
            except DistributedError as e:  # down again: the next check or call tries again
                logger.warning("%s", e)

    def attach(self, offer: pb.SharedMemoryOffer, plan: ShardPlan, required: bool) -> None:
        """Map the server's shared-memory segments, or stay with gRPC bytes when they
        cannot be mapped from here (another machine).

        Raises:
            DistributedError: `required`, and the segments cannot be mapped.
        """
        try:
            self.segments = SegmentPair.attach(offer, plan.nbytes, plan.dtype)
            logger.info("shard %d at %s shares this machine: payloads go through shared memory",
                        self.shard, self.address)
        except SharedMemoryUnavailable as e:
            if required:
                raise DistributedError(f"shard {self.shard} at {self.address}: shared memory "
                                       f"unavailable ({e}); use ps.payload_transport: auto or "
                                       "grpc when servers run on other machines") from e
            logger.info("shard %d at %s is on another machine (%s): payloads go through gRPC",
                        self.shard, self.address, e)

    def _outgoing(self, data: memoryview) -> tuple[memoryview, int]:
        """The bytes a push's message carries (none when they went into shared memory,
        copied there now) and the payload's size."""
        data = memoryview(data).cast("B")
        if self.segments is None:
            return data, data.nbytes
        source, target = decode_tensor(data, torch.uint8), self.segments.gradient_tensor.view(torch.uint8)
        if source.data_ptr() != target.data_ptr():  # else: computed in the segment already
            target[:data.nbytes].copy_(source)
        return memoryview(b""), data.nbytes

    def _frames(self, header: pb.GradientMessage, plan: ShardPlan, data: memoryview) -> list[bytes]:
        """The messages of one attempt of a push (`_stamped_header`)."""
        return list(service.gradient_frames(self._stamped_header(header), plan, data))

    def _stamped_header(self, header: pb.GradientMessage) -> pb.GradientMessage:
        """A copy of `header` stamped with how the push's bytes go, the server incarnation
        and the session as they are now."""
        header_copy = pb.GradientMessage()
        header_copy.CopyFrom(header)
        header_copy.shared_memory = self.segments is not None
        header_copy.incarnation, header_copy.session = self.incarnation, self.session
        header_copy.holds_version = self.holds_version
        if not header.redo and not header.stand_in:
            self.pushing_step = header.sync_step
        return header_copy

    def _lose_reply(self, step: int) -> None:
        if self.drop_replies > 0:
            self.drop_replies -= 1
            raise ReplyLost(f"the reply of step {step}'s push was dropped (injected fault)")

    def push(self, header: pb.GradientMessage, plan: ShardPlan, data: memoryview,
             written: Written | None = None) -> tuple[pb.PushReply, int]:
        """Send one gradient (raw values, or a compressed payload when `header.compressed`);
        returns the reply and the payload bytes sent (a retry sends them again; the
        messages' framing, some hundred bytes, is not counted). With `written` (raw values
        through gRPC messages), `data` is still being written by backward: the push streams
        its pieces last first as they are (`Written`).

        Raises:
            DistributedError: the push failed for good.
            BaseException: `written` was aborted (its error).
        """
        if written is not None:
            return self._push_streamed(header, plan, data, written)
        data, nbytes = self._outgoing(data)
        sent = [0]

        def attempt():
            frames = self._frames(header, plan, data)
            sent[0] += nbytes
            if len(frames) == 1:
                reply = self._calls["PushGradients"](frames[0], timeout=self.policy.timeout_s,
                                                     wait_for_ready=True)
            else:
                reply = self._calls["SendGradients"](iter(frames), timeout=self.policy.timeout_s,
                                                     wait_for_ready=True)
            self._lose_reply(header.step)
            return reply

        reply = self._retry("SendGradients", attempt)
        if reply.incarnation not in (0, self.incarnation):
            self.rejoin(reply.incarnation)  # the server restarted: it has read nothing of this push
        return reply, sent[0]

    def _push_streamed(self, header: pb.GradientMessage, plan: ShardPlan, data: memoryview, written: Written
                       ) -> tuple[pb.PushReply, int]:
        """`push` of bytes backward is still writing: one SendGradients stream whose pieces
        go last first, each once written (a retry streams them again, from what is written)."""
        if self.segments is not None:
            raise ValueError("a push through shared memory has no pieces to stream")
        data = memoryview(data).cast("B")
        sent = [0]

        def attempt():
            ready = written.attempt()
            frames = service.gradient_frames_from_end(self._stamped_header(header), plan, data, ready)
            call = self._calls["SendGradients"].future(frames, timeout=self.policy.timeout_s,
                                                       wait_for_ready=True)
            written.on_abort(call.cancel)
            sent[0] += data.nbytes
            try:
                reply = call.result()
            except (grpc.RpcError, grpc.FutureCancelledError):
                if written.error is not None:
                    raise written.error from None
                raise
            self._lose_reply(header.step)
            return reply

        reply = self._retry("SendGradients", attempt)
        if reply.incarnation not in (0, self.incarnation):
            self.rejoin(reply.incarnation)
        return reply, sent[0]

    def step(self, header: pb.GradientMessage, plan: ShardPlan, data: memoryview, into: torch.Tensor
             ) -> tuple[pb.PushReply, int | None, int, int]:
        """Push one gradient and take the parameters it leads to into `into`, in one round
        trip on this shard's Step stream (see `StepStream`); under pull compression the
        answer may be the change from the version `into` holds.

        Returns:
            (the push's reply, the version now in `into` or None when the reply brought no
            parameters (ROLLED_BACK), payload bytes sent, payload bytes received).
        """
        data, nbytes = self._outgoing(data)
        sent = [0]

        def attempt():
            (message,) = self._frames(header, plan, data)
            sent[0] += nbytes
            answer = self.stream.exchange(message, self.policy.timeout_s)
            self._lose_reply(header.step)
            return answer

        answer = self._retry("Step", attempt)
        reply = answer.header.push
        if reply.incarnation not in (0, self.incarnation):
            self.rejoin(reply.incarnation)
        if reply.outcome == ROLLED_BACK:
            return reply, None, sent[0], 0
        # Payload bytes, counted as a pull counts them (through shared memory too).
        received = answer.data.nbytes if answer.header.compressed else plan.nbytes
        return reply, self._land(answer, plan, 0, into), sent[0], received

    def pull(self, worker_id: str, plan: ShardPlan, min_version: int, into: torch.Tensor,
             policy: RetryPolicy | None = None) -> tuple[int, int]:
        """Copy the shard's parameters, once at `min_version`, into `into` (its flat slice);
        `policy`: deadlines and retries other than the shard's.

        Returns:
            (version, payload bytes received).
        """
        policy = policy or self.policy
        segments = self.segments
        request = pb.ParameterRequest(worker_id=worker_id, min_version=min_version, shard=plan.shard,
                                      shared_memory=segments is not None)

        one_message = segments is not None or service.fits_one_message(plan.nbytes)

        def attempt():
            request.incarnation, request.session = self.incarnation, self.session
            if one_message:
                frame = self._calls["FetchParameters"](request, timeout=policy.timeout_s,
                                                       wait_for_ready=True)
                return Payload(frame.header, frame.meta, [frame.data])
            stream = self._calls["GetParameters"](request, timeout=policy.timeout_s,
                                                  wait_for_ready=True)
            return service.collect_payload(iter(stream), plan.nbytes)

        payload = self._retry("GetParameters", attempt, policy=policy)
        if payload.header.incarnation not in (0, self.incarnation):
            logger.warning("shard %d at %s restarted at version %d (this worker waited for %d)",
                           plan.shard, self.address, payload.header.version, min_version)
            self.rejoin(payload.header.incarnation)
            return self.pull(worker_id, plan, 0, into)
        return self._land(payload, plan, min_version, into), plan.nbytes

    def _land(self, answer: Payload | Frame, plan: ShardPlan, min_version: int, into: torch.Tensor) -> int:
        """Copy the parameters of an answer into `into` (from shared memory when they went
        there); their version.

        Raises:
            DistributedError: not the version, size or transport asked for.
        """
        segments = self.segments
        chunks = answer.chunks if isinstance(answer, Payload) else [answer.data]
        if answer.header.compressed:
            return self._land_change(answer, plan, chunks, into)
        nbytes, expected = sum(chunk.nbytes for chunk in chunks), 0 if segments is not None else plan.nbytes
        if answer.header.version < min_version or nbytes != expected \
                or answer.header.shared_memory != (segments is not None):
            raise DistributedError(f"shard {plan.shard} answered version {answer.header.version} "
                                   f"with {nbytes} bytes; expected version >= {min_version} "
                                   f"and {expected} bytes")
        try:
            buffers = service.read_buffers(answer.header, plan, f"the answer of shard {plan.shard}")
        except ValueError as e:
            raise DistributedError(str(e)) from e
        if segments is not None:
            if into.data_ptr() != segments.parameter_tensor.data_ptr():  # else: landed in place
                into.copy_(segments.parameter_tensor)
        else:
            copy_chunks(decode_chunks(chunks, plan.dtype), into)
        if buffers is not None:
            self.buffers = buffers
        self.holds_version = answer.header.version + 1
        self.sync_step, self.restored = answer.header.sync_step, answer.header.restored
        return answer.header.version

    def _land_change(self, answer: Payload | Frame, plan: ShardPlan, chunks: list[memoryview],
                     into: torch.Tensor) -> int:
        """Add the changes of a compressed answer into `into`, which holds the version of
        the shard's broadcast copy they start from (one change per version between it and
        the answer's, oldest first: `ParameterChanges.add_all`); its version.

        Raises:
            DistributedError: this worker does not expect changes, holds no version before
                the answer's, or the changes do not decode (`into` is then unchanged).
        """
        header, changes = answer.header, self.changes
        behind = header.version - (self.holds_version - 1)
        if changes is None or header.compression_type != changes.scheme or self.segments is not None \
                or self.holds_version < 1 or behind < 1:
            raise DistributedError(
                f"shard {plan.shard} answered version {header.version} with a {header.compression_type} "
                f"change, but this worker holds version {self.holds_version - 1} and pulls "
                f"{changes.scheme if changes else 'dense'}; start servers and workers with the same "
                "compression.pull")
        try:
            buffers = service.read_buffers(header, plan, f"the answer of shard {plan.shard}")
            if self._scratch is None or self._scratch.numel() != into.numel():
                self._scratch = torch.empty_like(into)
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            changes.add_all(into, data, behind, self._scratch)
        except (ValueError, InvalidPayload) as e:
            raise DistributedError(f"the answer of shard {plan.shard}: {e}") from e
        if buffers is not None:
            self.buffers = buffers
        self.holds_version = header.version + 1
        self.sync_step, self.restored = header.sync_step, header.restored
        return header.version

    def close(self) -> None:
        self.stream.shutdown()
        self.channel.close()
