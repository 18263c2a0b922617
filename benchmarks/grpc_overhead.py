"""The fixed cost of one small gRPC round trip in Python, by server kind and call shape.

A server in its own process echoes 200-byte messages; the client, in this process, makes
round trips of four shapes against two servers: unary calls and ping-pongs on one
bidirectional stream kept open, each against the threaded `grpc.server` (what the
parameter server runs) and against `grpc.aio`'s asyncio server. The unary calls also
run through a server with the run's token interceptor, for what authentication adds.
Reports the median microseconds per round trip of each, interleaved over repeats, and
the ratios against the threaded unary call. No tensor bytes: only what a call costs.
"""

from __future__ import annotations

import asyncio
import queue
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from common import median, parse_args, report, time_interleaved

from disttrain.core import TokenInterceptor, with_token

SERVICE = "bench.Echo"
MESSAGE = b"x" * 200
TOKEN = "bench-token-0123456789abcdef0123456789"


def identity(data: bytes) -> bytes:
    return data


def handlers(unary, stream) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, identity, identity),
        "Stream": grpc.stream_stream_rpc_method_handler(stream, identity, identity)})


def serve_threaded(with_token: bool) -> None:
    """Role: the threaded server, as the parameter server runs it."""
    interceptors = [TokenInterceptor(TOKEN)] if with_token else []
    server = grpc.server(ThreadPoolExecutor(8), interceptors=interceptors)
    server.add_generic_rpc_handlers([handlers(lambda request, context: request,
                                              lambda requests, context: (r for r in requests))])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes it
    server.stop(0)


def serve_aio() -> None:
    """Role: the asyncio server."""
    async def unary(request, context):
        return request

    async def stream(requests, context):
        async for request in requests:
            yield request

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([handlers(unary, stream)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop(0)

    asyncio.run(main())


def start(role: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, __file__, "--role", role], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    return process, f"127.0.0.1:{process.stdout.readline().strip()}"


class Pinger:
    """Round trips to one server: unary calls, or ping-pongs on one open stream."""

    def __init__(self, address: str, token: str | None = None):
        self.channel = with_token(grpc.insecure_channel(address), token)
        self.unary = self.channel.unary_unary(f"/{SERVICE}/Unary", identity, identity)
        stream = self.channel.stream_stream(f"/{SERVICE}/Stream", identity, identity)
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.replies = stream(iter(self.requests.get, None))
        self.unary(MESSAGE, timeout=30, wait_for_ready=True)

    def calls(self, count: int) -> None:
        for _ in range(count):
            self.unary(MESSAGE, timeout=30)

    def pings(self, count: int) -> None:
        for _ in range(count):
            self.requests.put(MESSAGE)
            next(self.replies)

    def close(self) -> None:
        self.requests.put(None)
        self.channel.close()


def extra(parser) -> None:
    parser.add_argument("--role", choices=["threaded", "threaded-token", "aio"], help=None)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], extra)
    if args.role == "aio":
        return serve_aio()
    if args.role:
        return serve_threaded(args.role == "threaded-token")
    count = 200 if args.quick else 2000
    started = {role: start(role) for role in ("threaded", "threaded-token", "aio")}
    try:
        threaded, aio = Pinger(started["threaded"][1]), Pinger(started["aio"][1])
        token = Pinger(started["threaded-token"][1], TOKEN)
        variants = {"threaded_unary": lambda: threaded.calls(count),
                    "threaded_unary_token": lambda: token.calls(count),
                    "aio_unary": lambda: aio.calls(count),
                    "threaded_stream": lambda: threaded.pings(count),
                    "aio_stream": lambda: aio.pings(count)}
        times = time_interleaved(variants, args.repeats)
        for pinger in (threaded, aio, token):
            pinger.close()
    finally:
        for process, _ in started.values():
            process.stdin.close()
            process.wait(timeout=30)
    per_call_us = {name: median(runs) / count * 1e6 for name, runs in times.items()}
    base = per_call_us["threaded_unary"]
    report("grpc_overhead", {
        "round_trips_per_run": count, "repeats": args.repeats,
        "median_us_per_round_trip": {name: round(us, 1) for name, us in per_call_us.items()},
        "vs_threaded_unary": {name: round(us / base, 3) for name, us in per_call_us.items()},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")},
        args.output, target="the cheapest shape is what the parameter server's step uses (README)")


if __name__ == "__main__":
    main()
