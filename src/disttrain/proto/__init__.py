"""Generated protobuf and gRPC stubs of proto/disttrain/v1 (regenerate with `make proto`)."""
