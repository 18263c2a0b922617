"""Generated fault schedules over whole runs, and the invariants every run must keep.

The promises of the fault-tolerance table (DESIGN.md) are tested the way FoundationDB and
Jepsen test theirs: not one scripted fault at a time, but schedules drawn from a seed
over every role of a real run (its coordinator, shards, workers or ranks, started by
`disttrain ps` or `disttrain ddp` as a user starts them), with the interactions nobody
thinks to script (a second fault before the next checkpoint, a fault during the recovery
from the last one, during a checkpoint write, at an epoch boundary). After each run the
invariants are read from what the run left on disk (the shards' ledgers, the checkpoints,
the final model, the registry), not from what the processes say of themselves.

- `scenarios`: the configurations (PS sync, SSP, async; overlap, compression, pull
  compression, local updates, reassignment, three shards; DDP restart and live; and,
  run when named, a PS run and a live DDP group that grow and shrink while they run).
- `schedule`: from a seed and a scenario, the faults (pure; printed and saved with every
  result, so any failure reproduces from its seed).
- `elastic`: an elastic run's changes of size while it runs, drawn from a seed (pure).
- `invariants`: the checks on a finished or stopped run.
- `outside`: the signals sent from outside, each by a thread (`Sender`): kills and hangs
  by the clock, preemptions (SIGTERM to the launcher or to one member once the run
  reaches a step) and an elastic PS run's grows and leaves.
- `arrivals`: a live elastic DDP group's arrivals (`--join` launchers), planned leaves and
  rank kills, sent from outside.
- `runner`: runs one schedule (the timed faults from outside, the step-triggered ones by
  `--inject`; a preempted run resumed with `--resume`, maybe on another number of
  workers or ranks, as a chain of launches), reaps, and checks.

`disttrain chaos` runs them; `make chaos` runs hundreds and writes the JSON.
"""
