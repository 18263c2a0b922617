"""What the tests on the test's S3 server share (its fixtures, `moto_port` and `bucket`, are
in the conftest): the runs' environment, this process pointed at the server, a fresh
bucket, and a CLI run on a data set in the store with its final model read back. Importing
it skips the module, with the reason, where s3fs is missing."""

from __future__ import annotations

import uuid

import fsspec.config
import pytest
import torch
from s3_server import CREDENTIALS

s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'disttrain[s3]')")


def endpoint_env(port):
    return {**CREDENTIALS, "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}


def point_at(port, monkeypatch):
    """This process reaches the server on `port` through the same env as the runs."""
    for key, value in endpoint_env(port).items():
        monkeypatch.setenv(key, value)
    # fsspec read FSSPEC_S3_ENDPOINT_URL into its config when it was imported: set it there.
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": f"http://127.0.0.1:{port}"})
    # The library's own instances (fsspec caches them) must reach this port too.
    s3fs.S3FileSystem.clear_instance_cache()


def new_bucket(port):
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(endpoint_url=f"http://127.0.0.1:{port}", skip_instance_cache=True).mkdir(name)
    return name


def run_on_store(cli, args, folder, dataset, port, *extra, command="baseline", data=None, timeout=150):
    """`disttrain COMMAND ARGS --dataset DATASET` with its data, logs and checkpoints in
    `folder` (the data folder `data` where given), reaching the server on `port`."""
    folders = ["--data-dir", data or folder / "data", "--log-dir", folder / "logs", "--checkpoint-dir",
               folder / "ckpt"]
    return cli(command, *args, "--dataset", dataset, *folders, *extra, env=endpoint_env(port),
               timeout=timeout)


def final_model(folder):
    return torch.load(folder / "ckpt" / "baseline_final.pt", weights_only=True)["model"]


def same(one, other) -> bool:
    return one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)
