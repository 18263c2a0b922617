"""Generated protobuf message classes of proto/disttrain/v1 (regenerate with `make proto`).

The wire contract, public as modules (`from disttrain.proto import parameter_server_pb2`),
each loaded when first imported."""

__all__ = ["coordinator_pb2", "parameter_server_pb2", "tensor_pb2"]
