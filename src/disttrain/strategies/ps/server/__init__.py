"""A parameter-server shard: its state (`shard`), the pure rules it composes, and the thin
gRPC servicer over it."""
