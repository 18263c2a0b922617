"""The one metrics vocabulary: every key any strategy logs, with its unit and meaning.

A key means the same thing in every strategy; where a figure means something else it
gets a key of its own (`time/comm_blocked_s` against `time/comm_overlapped_s`). The
logger refuses a key that is not here, and the README's metrics table is `markdown()`.

Every time comes from one clock, the training clock: it runs while a process trains and
stops during evaluation and checkpoint writes. A run's `train_time_s` is the longest
training clock of its processes, and `throughput_samples_per_s` is the samples all its
processes trained on divided by it.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPRESSED = "ps (compression on), ddp (compression on)"
LOCAL_UPDATES = "ps (local updates), ddp (local updates)"
LANGUAGE_MODELS = "all (language-model data sets)"
DDP_LIVE = "ddp (ddp.recovery live)"

# How a logged value relates to the steps it covers.
WINDOW = "window"          # over the steps since the previous record
PER_STEP = "per step"      # the mean per step over the steps since the previous record
CUMULATIVE = "cumulative"  # since the run started (a resumed run goes on counting)
EPOCH_END = "epoch end"    # once per epoch, after its last step
RUN = "run"                # once per run, in summary.json

# Test accuracies whose time to reach a classifier's summary records (`time_to_accuracy_s`).
ACCURACY_THRESHOLDS = (0.90, 0.95, 0.97, 0.98)
# Test perplexities whose time to reach a language model's summary records
# (`time_to_perplexity_s`). Byte-level text: a uniform guess is 256; knowing which bytes
# occur and how often takes it to about 20-30; a small GPT trained on English goes
# below 8 and, trained long, towards 4.
PERPLEXITY_TARGETS = (32.0, 16.0, 8.0, 4.0)


@dataclass(frozen=True)
class Metric:
    key: str
    unit: str
    kind: str
    meaning: str
    logged_by: str  # which strategies write it


ALL = "all"
METRICS: dict[str, Metric] = {m.key: m for m in [
    Metric("loss/train", "nats", WINDOW, "mean cross-entropy of the samples trained on (a "
           "language model's: of their tokens)", ALL),
    Metric("accuracy/train", "fraction", WINDOW, "share of the samples trained on that the model "
           "classified right, before its update (classification data sets; a language model logs "
           "`perplexity/train` instead)", ALL),
    Metric("perplexity/train", "ratio", WINDOW, "exp(`loss/train`): a language model's figure in "
           "place of `accuracy/train`", LANGUAGE_MODELS),
    Metric("throughput/samples_per_s", "samples/s", WINDOW, "samples this process trained on, "
           "divided by the training-clock seconds they took", ALL),
    Metric("time/step_s", "s", PER_STEP, "training-clock time of one step, from taking its batch "
           "to holding the parameters the next step starts from", ALL),
    Metric("time/compute_s", "s", PER_STEP, "the part of a step not blocked on communication: "
           "`time/step_s` - `time/comm_blocked_s`", ALL),
    Metric("time/comm_blocked_s", "s", PER_STEP, "time a step waited on communication with no "
           "computation of its own running (PS: the pushes and pulls still in flight after the "
           "backward pass; DDP: the all-reduce still in flight after the backward pass computed "
           "its last bucket)", "ps, ddp"),
    Metric("time/comm_overlapped_s", "s", PER_STEP, "time communication was in flight while the "
           "step still computed, overlaps counted once (DDP: buckets during the backward pass; PS "
           "sync: each shard's push and pull, launched once the backward pass produced its "
           "gradient, or from when it wrote the shard's last tensor where the push streams its "
           "pieces; PS async and ssp: the prefetch of parameters during the computation, 0 "
           "when each push trades for parameters in one round trip after it; local updates with "
           "`training.outer_delay` (both): a fragment's exchange in flight beside the inner steps, "
           "logged at the step it lands)", "ps, ddp"),
    Metric("comm/bytes_sent", "bytes", PER_STEP, "gradient bytes this worker sent to the servers, "
           "through gRPC or shared memory (a retried push counts again; message framing, some "
           "hundred bytes, does not)", "ps"),
    Metric("comm/bytes_received", "bytes", PER_STEP, "parameter bytes this worker received from "
           "the servers, counted like `comm/bytes_sent`", "ps"),
    Metric("comm/bytes_allreduced", "bytes", PER_STEP, "gradient bytes this rank handed to "
           "all-reduce (with local updates: pseudo-gradient bytes, at a round's end only)", "ddp"),
    Metric("local/rounds", "rounds", PER_STEP, "local-update rounds that ended (the pseudo-gradient "
           "averaged and the outer optimizer applied): per step, 1/`training.sync_every` but for "
           "rounds an epoch's end cut short", LOCAL_UPDATES),
    Metric("local/exchange_bytes", "bytes", PER_STEP, "dense bytes of the largest pseudo-gradient "
           "exchange of the step (with `training.outer_fragments` > 1 one fragment's; 0 within a round)",
           "ddp (local updates)"),
    Metric("compression/bytes_dense", "bytes", PER_STEP, "gradient bytes before compression: "
           "what the same step sends uncompressed", COMPRESSED),
    Metric("compression/bytes_sent", "bytes", PER_STEP, "gradient payload bytes after compression, "
           "metadata and indices counted (DDP: what this rank contributes to each collective)",
           COMPRESSED),
    Metric("compression/ratio", "ratio", WINDOW, "`compression/bytes_dense` / `compression/bytes_sent` "
           "over the window", COMPRESSED),
    Metric("compression/dense_segments", "tensors", PER_STEP, "tensors sent uncompressed because "
           "compressing them would not have saved bytes (tiny tensors, a ratio near 1)",
           COMPRESSED),
    Metric("time/compression_s", "s", PER_STEP, "time spent compressing gradients and decoding "
           "payloads (PS: the worker's encoding, before its push; DDP: inside the communication "
           "hooks, partly while the backward pass still computes)", COMPRESSED),
    Metric("ps/staleness", "versions", PER_STEP, "updates the servers had applied since the "
           "parameters a pushed gradient was computed on (the largest over shards)", "ps"),
    Metric("ps/sync_step", "steps", PER_STEP, "sync mode: the run's step of the parameters the "
           "step's gradient was computed on (the lowest over shards; the step before this one in a "
           "run without failures)", "ps"),
    Metric("ps/step_spread", "steps", PER_STEP, "sync mode: how many steps apart the shards' "
           "parameters a gradient was computed on were (highest minus lowest); 0 unless a shard came "
           "back from an older checkpoint: a worker never computes on shards of different steps "
           "otherwise", "ps"),
    Metric("ps/rejected_pushes", "pushes", PER_STEP, "ssp: pushes a shard rejected as too stale "
           "(the gradient was recomputed on fresh parameters)", "ps"),
    Metric("optim/learning_rate", "rate", PER_STEP, "the learning rate of the step's update, by "
           "the schedule (parameter server: the rate shard 0 applied the worker's gradient with, "
           "by its count of updates, as its answer tells; async and ssp shards count their own, "
           "so another shard's may be a schedule step apart)", "baseline, ddp, ps"),
    Metric("optim/grad_norm", "L2 norm", PER_STEP, "global norm of the gradient applied, before "
           "clipping (DDP: the averaged one)", "baseline (clipping on), ddp (clipping on)"),
    Metric("progress/samples", "samples", CUMULATIVE, "samples this process trained on", ALL),
    Metric("progress/train_time_s", "s", CUMULATIVE, "this process's training clock (both progress "
           "keys are on the evaluation records too: test accuracy against training time)", ALL),
    Metric("loss/test", "nats", EPOCH_END, "mean cross-entropy over the whole test set (a "
           "language model's: over its tokens)", ALL),
    Metric("accuracy/test", "fraction", EPOCH_END, "share of the whole test set classified "
           "right (classification data sets; a language model logs `perplexity/test` instead)", ALL),
    Metric("perplexity/test", "ratio", EPOCH_END, "exp(`loss/test`), the mean token cross-entropy "
           "over the whole test set: a language model's figure in place of `accuracy/test`",
           LANGUAGE_MODELS),
    Metric("time/eval_s", "s", EPOCH_END, "wall time of the evaluation, off the training clock",
           ALL),
]}

SUMMARY: dict[str, Metric] = {m.key: m for m in [
    Metric("final_accuracy", "fraction", RUN, "test accuracy of the final model (a language "
           "model's: the share of next tokens predicted right)", ALL),
    Metric("final_loss", "nats", RUN, "test loss of the final model", ALL),
    Metric("train_time_s", "s", RUN, "the longest training clock of the run's processes "
           "(evaluation and checkpoint writes left out)", ALL),
    Metric("throughput_samples_per_s", "samples/s", RUN, "`samples_processed` / `train_time_s`",
           ALL),
    Metric("samples_processed", "samples", RUN, "samples trained on by all processes together",
           ALL),
    Metric("steps", "updates", RUN, "updates applied to the model (PS: shard 0's version)", ALL),
    Metric("total_time_s", "s", RUN, "wall time from the start of the command to the summary, "
           "set-up and evaluation included", ALL),
    Metric("time_to_accuracy_s", "s", RUN, "for each test accuracy of `ACCURACY_THRESHOLDS`, "
           "keyed with two decimals (`\"0.90\"`, `\"0.95\"`, `\"0.97\"`, `\"0.98\"`): the training "
           "clock of the process that writes the summary (PS: worker 0, DDP: rank 0) at the first "
           "epoch-end evaluation that reached it; null where none did (empty for a language model, "
           "which has `time_to_perplexity_s`)", ALL),
]}


# Fields a summary has only in some runs.
OPTIONAL_SUMMARY: dict[str, Metric] = {m.key: m for m in [
    Metric("task", "name", RUN, "the data set's task when it is not classification: "
           "`language-model`", LANGUAGE_MODELS),
    Metric("final_perplexity", "ratio", RUN, "exp(`final_loss`), the language model's figure "
           "reported in place of accuracy", LANGUAGE_MODELS),
    Metric("time_to_perplexity_s", "s", RUN, "for each test perplexity of `PERPLEXITY_TARGETS`, "
           "keyed as written (`\"32\"`, `\"16\"`, `\"8\"`, `\"4\"`): the training clock, as in "
           "`time_to_accuracy_s`, at the first epoch-end evaluation at or below it; null where none "
           "reached it", LANGUAGE_MODELS),
    Metric("compression_ratio", "ratio", RUN, "gradient bytes before compression / bytes sent, "
           "over the whole run and every process (present when compression is on)", "ps, ddp"),
    Metric("compression_bytes_sent", "bytes", RUN, "gradient payload bytes all processes sent, "
           "compressed (present when compression is on)", "ps, ddp"),
    Metric("bytes_sent", "bytes", RUN, "gradient payload bytes all workers pushed to the servers "
           "(`comm/bytes_sent` over the run), beside `bytes_received`", "ps"),
    Metric("bytes_received", "bytes", RUN, "parameter payload bytes all workers pulled from the "
           "servers (`comm/bytes_received` over the run): compressed changes under pull compression",
           "ps"),
    Metric("compression_pull_ratio", "ratio", RUN, "parameter bytes the pulls would have taken "
           "dense / `bytes_received` (present with `compression.pull`)", "ps"),
    Metric("compression_bytes_received", "bytes", RUN, "parameter payload bytes pulled under pull "
           "compression, all workers (present with `compression.pull`)", "ps"),
    Metric("local_rounds", "rounds", RUN, "local-update rounds completed (present with local "
           "updates, beside `sync_every`, `outer_optimizer`, `outer_learning_rate` and "
           "`outer_momentum`)", "ddp"),
    Metric("outer_fragments", "fragments", RUN, "Streaming DiLoCo: the fragments the parameters are "
           "exchanged in, beside `outer_mixing` and `outer_compression` (present with any of them set)",
           "ddp (local updates)"),
    Metric("outer_mixing", "ratio", RUN, "Streaming DiLoCo: the share of a worker's own parameters kept "
           "after a fragment's outer step", "ddp (local updates)"),
    Metric("outer_compression", "scheme", RUN, "Streaming DiLoCo: how pseudo-gradients were exchanged "
           "(none, fp16, int8)", "ddp (local updates)"),
    Metric("outer_delay", "steps", RUN, "Streaming DiLoCo: the inner steps each fragment's exchange "
           "overlapped before its outer result was applied (0: the step waited)", "ddp (local updates)"),
    Metric("samples_applied", "samples", RUN, "samples whose gradients the servers applied, from "
           "their data ledgers (every sample of every epoch once); DDP live recovery: samples of the "
           "global batches whose update the model holds, from the group's ledger", f"ps, {DDP_LIVE}"),
    Metric("samples_redone", "samples", RUN, "samples computed again after a failure (turned "
           "away as duplicates, or redone where a restarted shard lacked them; DDP live recovery: the "
           "survivors' pieces of steps whose all-reduce failed)", f"ps, {DDP_LIVE}"),
    Metric("samples_taken_over", "samples", RUN, "samples of the blocks of workers reassigned "
           "(away past `coordinator.reassign_after`) that the others took over; "
           "`reassigned_workers` lists the ranks of those still away at the end", "ps"),
    Metric("samples_lost", "samples", RUN, "samples of blocks some shard never applied, other "
           "than those dropped late (must be 0); DDP live recovery: samples of global batches the "
           "ledger shows never applied", f"ps, {DDP_LIVE}"),
    Metric("samples_dropped_late", "samples", RUN, "samples of the gradients synchronous steps "
           "went on without, by design (backup workers)", "ps"),
    Metric("max_round_wait_s", "s", RUN, "the longest a synchronous step waited between its "
           "first and last gradient", "ps"),
    Metric("num_failures", "count", RUN, "process failures the run recovered from; `failures` "
           "lists each with `detect_s` (to detect it), `recover_s` (until the process was back "
           "at work), `restart_s`, and for a restarted worker `first_step_s` (from its exit to its first "
           "step done again) and `spare` (the hot spare restarted as it, if any)", "ps"),
    # DDP live recovery (`ddp.recovery: live`); times are wall-clock seconds.
    Metric("ddp_recovery", "name", RUN, "`live`: the run's ranks recovered without a restart", DDP_LIVE),
    Metric("samples_applied_twice", "samples", RUN, "samples of global batches the ledger shows "
           "applied more than once (must be 0)", DDP_LIVE),
    Metric("samples_trained", "samples", RUN, "samples the ranks alive at the end computed, failed "
           "steps included (dead processes' work is not counted)", DDP_LIVE),
    Metric("rank_pids", "process ids", RUN, "per rank, the id of every process the launcher started "
           "for it, in order (a survivor has one: it was never restarted)", DDP_LIVE),
    Metric("final_pids", "process ids", RUN, "per rank in the last group, the id of its process", DDP_LIVE),
    Metric("num_rejoins", "count", RUN, "times the group took a rank back", DDP_LIVE),
    Metric("live_recoveries", "list", RUN, "each re-forming of the group: `kind` (`shrink` after a "
           "loss, `grow` to take ranks back or in, `leave` when SIGTERMed ranks left, `restore` when "
           "every member was lost and the restarted ranks formed a group from the newest checkpoint, "
           "`resume` for the first group of a `--resume`), `generation`, `members`, `step`, `spares` (the "
           "hot spares it took in, when any), and its seconds `detect_s`, `reform_s`, `resume_s` "
           "(shrink) or `rejoin_s` (the others)", DDP_LIVE),
    Metric("live_world_sizes", "ranks", RUN, "the sizes the group trained at, in order: the run's "
           "first, then the size after each re-forming that changed it", DDP_LIVE),
    Metric("min_world_size", "ranks", RUN, "an elastic run's MIN (--world-size MIN:MAX): the ranks "
           "it started and the fewest it trains with", DDP_LIVE),
    Metric("max_world_size", "ranks", RUN, "an elastic run's MAX: the most ranks it takes", DDP_LIVE),
    Metric("live_detect_s", "s", RUN, "the longest from a rank's death (its launcher saw the exit) to "
           "the survivors noticing it (0 when they noticed first)", DDP_LIVE),
    Metric("live_reform_s", "s", RUN, "the longest from the survivors noticing a loss to their new "
           "group training again", DDP_LIVE),
    Metric("live_resume_s", "s", RUN, "the longest from a rank's death to the survivors training "
           "again", DDP_LIVE),
    Metric("live_rejoin_s", "s", RUN, "the longest from a rank's restart to the group training with "
           "it (the restarted process's start-up included)", DDP_LIVE),
    Metric("num_spares", "count", RUN, "hot spares started beside the group (`--spares`; the parameter "
           "server's too, beside its workers)", DDP_LIVE),
    Metric("num_spares_started", "count", RUN, "spare processes started: the spares, and the lost ranks' "
           "processes started again as spares", DDP_LIVE),
    Metric("spare_step_ins", "list", RUN, "each spare that stepped in: `slot`, `step`, `generation`, `at` "
           "(wall clock) and `after_loss_s` (from the death or leave before it to the group training "
           "with it); the parameter server's: `slot`, `spare`, `pid`, `attempt`, `at` and `after_loss_s` "
           "(to the worker's first step done again)", DDP_LIVE),
]}


def check_keys(keys) -> None:
    """Raises ValueError naming any key that is not in the vocabulary (a programming error:
    add the key to `METRICS` with its unit and meaning first)."""
    unknown = sorted(set(keys) - set(METRICS))
    if unknown:
        raise ValueError(f"metric keys {unknown} are not in disttrain.metrics.keys.METRICS")


def markdown() -> str:
    """The README's metrics tables, made from this module."""
    lines = ["| key | unit | kind | meaning | logged by |", "|---|---|---|---|---|"]
    lines += [f"| `{m.key}` | {m.unit} | {m.kind} | {m.meaning} | {m.logged_by} |"
              for m in METRICS.values()]
    lines += ["", "| summary field | unit | meaning |", "|---|---|---|"]
    lines += [f"| `{m.key}` | {m.unit} | {m.meaning} |"
              for m in [*SUMMARY.values(), *OPTIONAL_SUMMARY.values()]]
    return "\n".join(lines) + "\n"


# Keys a parameter-server worker logs in sync mode only (the step agreement across shards).
SYNC_MODE_ONLY = frozenset({"ps/sync_step", "ps/step_spread"})
