"""Live recovery of a DDP run (`ddp.recovery: live`): survivors of a rank's death re-form
their group and train on, and the rank, started again, joins them at a step boundary.

Modules: `membership` (the pure rules: settling, members, the batch split, whose state
everyone takes), `group` (generations of process groups agreed through the launcher's
store), `forming` (a generation's rendezvous cut short when a member dies), `restart` (the
next generation started by the ranks waiting to join when every member died), `state` (a
state handed from a live peer, without pickle), `trainer` (model, optimizer, position and
data ledger), `checkpoints` (the leader's periodic checkpoints and `--resume`),
`participant` (live recovery's policy for the one DDP participant: the step boundary where
the group changes, the group's state, and the store its generation's leader writes),
`rank` (the generations of one rank process, each a run of the training loop; a SIGTERMed
rank leaves at a step boundary), `places` (the places of an elastic run or one with hot
spares: an arrival takes a free one, a spare a lost member's), `launcher` (starts and
restarts the ranks and the spares, hosts the store; `--join` adds a rank to an elastic
run).
"""

from disttrain.strategies.ddp.live.launcher import LIVE_STORE_ENV, launch_live, store_address
from disttrain.strategies.ddp.live.rank import run_live_rank

__all__ = ["LIVE_STORE_ENV", "launch_live", "run_live_rank", "store_address"]
