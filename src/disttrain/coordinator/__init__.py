"""The coordinator: membership, failure detection, the cluster registry, and the supervisor
that restarts failed processes.

Its face, for scripts and users: what a run's registry file says (`read_status`, the
`Snapshot` it returns, and `RegistryError` when the file is not a registry), and
`CoordinatorServer`, a coordinator served in this process (a benchmark's, a test's).
"""

from disttrain.coordinator.registry import RegistryError, Snapshot, read_status
from disttrain.coordinator.service import CoordinatorServer

__all__ = ["CoordinatorServer", "RegistryError", "Snapshot", "read_status"]
