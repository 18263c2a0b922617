"""The coordinator: membership, failure detection, the cluster registry, and the supervisor
that restarts failed processes."""
