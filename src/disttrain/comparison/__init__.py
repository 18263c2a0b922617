"""Runs of several strategies on one config: `compare` (plan, runner) and the final
checkpoint validation (validate). Each run is its own `disttrain` command."""
