"""`disttrain advise`: what a run would cost on a bigger cluster, predicted from this
machine. It measures one worker's step and each compressor on the model's gradients
(`workload`; `contention`: what an overlapped push takes from backward), a link (`link`,
`probe`), predicts every strategy with an α-β cost model (`costmodel`), chooses at each
size (`choice`), and replays the parameter server's own aggregation rules in virtual
time (`simulation`, `step_times`) for what the formulas leave out: stragglers, backup
workers, staleness, failures; `local_simulation` replays local updates, Streaming
DiLoCo's fragments and their delay. `payloads` sizes PowerSGD's and pull compression's
bytes from the model's shapes; `comparison` predicts a comparison report's scaling
section from the comparison's own runs."""

from disttrain.advise.choice import WORKER_COUNTS, Advice, CompressionChoices, advise, candidates, choose
from disttrain.advise.costmodel import COMPRESSIONS, STRATEGIES, Candidate, CostModel, Prediction, RoundTrip
from disttrain.advise.link import Link, parse_link
from disttrain.advise.local_simulation import simulate_local_updates
from disttrain.advise.probe import ProbeServer, measure_link, measure_loopback
from disttrain.advise.simulation import SimulationResult, SimulationSetup, simulate
from disttrain.advise.step_times import StepTimes
from disttrain.advise.workload import CompressionCost, Workload, measure_workload

__all__ = ["COMPRESSIONS", "STRATEGIES", "WORKER_COUNTS", "Advice", "Candidate", "CompressionChoices",
           "CompressionCost", "CostModel", "Link", "Prediction", "ProbeServer", "RoundTrip",
           "SimulationResult", "SimulationSetup", "StepTimes", "Workload", "advise", "candidates", "choose",
           "measure_link", "measure_loopback", "measure_workload", "parse_link", "simulate",
           "simulate_local_updates"]
