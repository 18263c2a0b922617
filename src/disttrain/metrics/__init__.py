"""What runs measure: the metrics vocabulary (`keys`), the training clock and window
(`window`), the JSONL + TensorBoard stream (`logger`), the progress display, the run
summary, its time to accuracy or perplexity targets (`time_to_target`) and the run's hyper-parameters for
TensorBoard's HPARAMS tab (`hparams`).

Its face, for scripts and users: the vocabulary, the stream and how to read it back, the
run summary, the step timer, and time to a target.
"""

from disttrain.metrics import keys
from disttrain.metrics.logger import MetricsLogger, read_metrics
from disttrain.metrics.summary import RunSummary
from disttrain.metrics.time_to_target import ACCURACY, PERPLEXITY, TimeToTarget
from disttrain.metrics.window import StepTimer

__all__ = [
    "ACCURACY",
    "PERPLEXITY",
    "MetricsLogger",
    "RunSummary",
    "StepTimer",
    "TimeToTarget",
    "keys",
    "read_metrics",
]
