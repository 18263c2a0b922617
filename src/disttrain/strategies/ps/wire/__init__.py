"""What a parameter-server worker and shard share: the bytes on the wire (codec, service),
who owns which slices (sharding), compressed payloads, and shared-memory segments."""
