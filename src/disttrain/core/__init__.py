"""The shared core every layer stands on: errors, logging, fault injection, addresses,
child processes, the C allocator, checkpoint files, and what every gRPC service shares (server setup, the
shared token, TLS, deadlines). It imports nothing else of the project.

Its face, for scripts and users (the project's own modules import the submodules): the
error hierarchy, `Cluster` (child processes that never outlive their parent), the
shared-token helpers of gRPC and `node_token` (a node's own token, made from the run's
secret), `Credentials` (a process's token and TLS files, as its servers and clients
take them), `access` (the authorization table: who may call what), and `tune_allocator`
(at a training process's start).
"""

from disttrain.core import access
from disttrain.core.allocator import tune_allocator
from disttrain.core.auth import TokenInterceptor, new_token, with_token, write_token_file
from disttrain.core.credentials import Credentials
from disttrain.core.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DistributedError,
    DisttrainError,
    InputFileError,
    TrainingError,
)
from disttrain.core.identity import node_token
from disttrain.core.processes import Cluster

__all__ = ["CheckpointError", "Cluster", "ConfigError", "Credentials", "DataError", "DistributedError",
           "DisttrainError",
           "InputFileError", "TokenInterceptor", "TrainingError", "access", "new_token", "node_token",
           "tune_allocator", "with_token", "write_token_file"]
