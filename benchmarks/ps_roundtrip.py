"""Push 10 MB + pull 10 MB through one parameter server, against a raw TCP echo of the
same bytes on loopback.

The server is a real `disttrain ps-server` process (async mode, SGD, one worker); the
echo server is a plain socket loop in another process that reads the bytes and sends
them back. The PS trades in one Step call; "two_calls" pushes, then pulls, as before Step.
Target: echo time / PS round-trip time >= 0.6.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import median, parse_args, report, time_interleaved
from ps_helpers import make_config, role_flags, servers

from disttrain.core import Cluster, tune_allocator
from disttrain.proto import parameter_server_pb2 as pb
from disttrain.strategies.ps import PSClient, RetryPolicy, flat_parameters, plan_shards, run_layout
from disttrain.training import init_model


def echo_server(nbytes: int) -> None:
    """Role: accept one connection; read `nbytes`, send them back, until it closes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    buffer = memoryview(bytearray(nbytes))
    while True:
        got = 0
        while got < nbytes:
            n = conn.recv_into(buffer[got:])
            if n == 0:
                return
            got += n
        conn.sendall(buffer)


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], role_flags)
    torch.set_num_threads(1)
    tune_allocator()
    with tempfile.TemporaryDirectory() as tmp, Cluster(Path(tmp) / "logs") as cluster:
        # Only the input shape of mnist matters here; no data is read.
        training = {"optimizer": "sgd", "dataset": "mnist", "num_epochs": 1000}  # epochs: room for every step
        if args.quick:
            training["mlp_hidden_size"] = 256
        config = make_config(Path(tmp), model="mlp", training=training, num_workers=1,
                             aggregation_mode="async")
        model = init_model(config.training)
        flat, grads = flat_parameters(model)
        grads.zero_()  # the server's work does not depend on the values
        plans = plan_shards(model, 1)
        client = PSClient(servers(cluster, config, Path(tmp)), plans, RetryPolicy())
        client.register("bench")
        nbytes = plans[0].nbytes
        state = {"step": 0, "version": 0}
        batches = run_layout(config).batches_per_epoch  # the shard takes only the worker's own blocks

        def next_header() -> pb.GradientMessage:
            state["step"] += 1
            return pb.GradientMessage(worker_id="bench", step=state["step"], base_version=state["version"],
                                      shard=0, num_samples=64, block_id=state["step"] - 1,
                                      epoch=(state["step"] - 1) // batches)  # its batch of the step

        # As a worker does, the model lives in the shard's segments (the two calls below
        # copy from and to memory of their own, as before Step).
        shared_flat, shared_grads = client.shared_buffers() or (flat.clone(), grads.clone())

        def ps_round_trip() -> None:
            client.step([next_header()], shared_grads, [0], shared_flat, [0])
            state["version"] = state["step"]  # async, one worker: each push is one version

        def ps_two_calls() -> None:  # as steps went before Step: a push, then a pull
            reply = client.push([next_header()], grads, [0])[0]
            state["version"] = client.pull("bench", flat, [reply.version])[0]

        echo = subprocess.Popen(
            [sys.executable, __file__, "--role", "echo", "--nbytes", str(nbytes)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            port = int(echo.stdout.readline())
            conn = socket.create_connection(("127.0.0.1", port))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            payload = bytes(grads.numpy().tobytes())
            back = memoryview(bytearray(nbytes))

            def tcp_echo() -> None:
                conn.sendall(payload)
                got = 0
                while got < nbytes:
                    got += conn.recv_into(back[got:])

            for _ in range(3):
                ps_round_trip()
                tcp_echo()
            variants = {"tcp_echo": tcp_echo, "ps": ps_round_trip, "ps_two_calls": ps_two_calls}
            times = time_interleaved(variants, max(args.repeats, 20))
            conn.close()
        finally:
            echo.kill()
            client.close()
    echo_s, ps_s, two_s = median(times["tcp_echo"]), median(times["ps"]), median(times["ps_two_calls"])
    report(
        "ps_roundtrip",
        {
            "bytes_each_way": nbytes,
            "tcp_echo_s": echo_s,
            "ps_push_pull_s": ps_s,
            "ps_two_calls_s": two_s,
            "tcp_echo_gb_per_s": 2 * nbytes / echo_s / 1e9,
            "ps_gb_per_s": 2 * nbytes / ps_s / 1e9,
            "ratio": echo_s / ps_s,
            "two_calls_ratio": echo_s / two_s,
        },
        args.output,
        target="ratio >= 0.6",
    )


if __name__ == "__main__":
    helper = argparse.ArgumentParser(add_help=False)
    role_flags(helper)
    known, _ = helper.parse_known_args()
    if known.role == "echo":
        echo_server(known.nbytes)
    else:
        main()
