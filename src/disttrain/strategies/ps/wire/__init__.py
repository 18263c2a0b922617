"""What a parameter-server worker and shard share: the bytes on the wire (codec, service),
who owns which slices (sharding), compressed payloads, and shared-memory segments.

Its face is the wire format itself, for tools that speak or measure it: `codec` (tensors
<-> bytes) and `service` (the service's methods, messages and their framing).
"""

from disttrain.strategies.ps.wire import codec, service

__all__ = ["codec", "service"]
