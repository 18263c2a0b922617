"""Generated protobuf message classes of proto/disttrain/v1 (regenerate with `make proto`)."""
