"""The coordinator: membership, failure detection, the cluster registry, and the supervisor
that restarts failed processes.

Its face, for scripts and users: what a run's registry file says (`read_status`, the
`Snapshot` it returns, and `RegistryError` when the file is not a registry).
"""

from disttrain.coordinator.registry import RegistryError, Snapshot, read_status

__all__ = ["RegistryError", "Snapshot", "read_status"]
