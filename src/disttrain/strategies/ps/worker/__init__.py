"""A parameter-server worker's side: clients of the shards, each mode's step, and the
worker's part in the training loop."""
