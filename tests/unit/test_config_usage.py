"""Which config keys a run ignores: each rule on the strategies it holds for and those it
does not, defaults and shipped configs silent, comparisons warned only about keys every
run ignores, and no rule naming a key that does not exist."""

import dataclasses
from pathlib import Path

import pytest

from disttrain.cli.config_warnings import warn_about_comparison_config, warn_about_run_config
from disttrain.config import STRATEGY_OF_ARCHITECTURE, Config, config_from_dict, load_config
from disttrain.config.schema import SECTIONS
from disttrain.config.usage import RULES, STRATEGIES, changed_keys, ignored_by_every_run, ignored_keys
from disttrain.core.processes import PARENT_ENV

SHIPPED = sorted((Path(__file__).resolve().parents[2] / "src" / "disttrain" / "configs").glob("*.yaml"))


def config_of(*sets: str) -> Config:
    return load_config(None, {}, list(sets))


def ignored(strategy: str, *sets: str) -> dict[str, str]:
    return {key.key: key.reason for key in ignored_keys(config_of(*sets), strategy)}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_default_config_ignores_nothing(strategy):
    assert changed_keys(Config()) == {}
    assert ignored_keys(Config(), strategy) == []


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_each_shipped_config_sets_only_what_its_own_strategy_reads(path):
    config = load_config(path)
    assert ignored_keys(config, STRATEGY_OF_ARCHITECTURE[config.system.architecture]) == []


# (keys set, strategy, key -> a part of the reason); the same keys under a strategy that
# acts on them are in ACTED_ON below.
IGNORED = [
    (["ps.staleness=5"], "ps", {"ps.staleness": "only ssp bounds staleness (ps.aggregation_mode is sync)"}),
    (["ps.aggregation_mode=async", "ps.backup_workers=1"], "ps",
     {"ps.backup_workers": "only a synchronous step"}),
    (["ps.aggregation_mode=ssp", "ps.overlap=false"], "ps",
     {"ps.overlap": "only a synchronous step overlaps its pushes"}),
    (["compression.enabled=true", "compression.type=quantization", "compression.ratio=0.5"], "ps",
     {"compression.ratio": "only topk"}),
    (["compression.ratio=0.5", "compression.type=topk"], "ddp",
     {"compression.ratio": "compression.enabled is false",
      "compression.type": "compression.enabled is false"}),
    (["compression.enabled=true", "compression.type=topk", "compression.powersgd_rank=4",
      "compression.stochastic_rounding=true"], "ddp",
     {"compression.powersgd_rank": "only powersgd", "compression.stochastic_rounding": "only quantization"}),
    (["compression.enabled=true", "compression.type=fp16", "compression.error_feedback=false"], "ddp",
     {"compression.error_feedback": "DDP's fp16 hook"}),
    (["compression.error_feedback=false"], "ps",
     {"compression.error_feedback": "compression.enabled is false"}),
    (["compression.enabled=true"], "baseline", {"compression.enabled": "the baseline sends no gradients"}),
    (["training.momentum=0.5"], "ddp", {"training.momentum": "only sgd takes momentum"}),
    (["ddp.static_graph=true", "ddp.bucket_cap_mb=5"], "ps",
     {"ddp.static_graph": "only DDP", "ddp.bucket_cap_mb": "only DDP"}),
    (["ddp.static_graph=true"], "baseline", {"ddp.static_graph": "only DDP"}),
    (["ps.num_servers=2", "ps.aggregation_mode=ssp"], "ddp",
     {"ps.num_servers": "only the parameter server", "ps.aggregation_mode": "only the parameter server"}),
    (["ps.num_servers=2"], "baseline", {"ps.num_servers": "only the parameter server"}),
    (["coordinator.heartbeat_timeout=9", "coordinator.max_restarts=1"], "baseline",
     {"coordinator.heartbeat_timeout": "without a coordinator", "coordinator.max_restarts": "without"}),
    (["coordinator.max_restarts=1"], "ddp", {"coordinator.max_restarts": "ddp.max_restarts"}),
    (["coordinator.address=node0:50050", "coordinator.heartbeat_timeout=9", "coordinator.straggler_factor=3"],
     "ps", {"coordinator.heartbeat_timeout": "node0:50050", "coordinator.straggler_factor": "node0:50050"}),
    (["ddp.num_nodes=2", "ddp.rdzv_endpoint=n0:29400", "system.num_workers=4",
      "coordinator.heartbeat_interval=2"], "ddp", {"coordinator.heartbeat_interval": "has no coordinator"}),
    (["system.balance=proportional", "system.balance_margin=0.5"], "baseline",
     {"system.balance": "the baseline's one process", "system.balance_margin": "the baseline's one process"}),
    (["system.num_workers=4"], "baseline", {"system.num_workers": "one process"}),
    (["system.balance=proportional", "system.balance_margin=0.5"], "ps",
     {"system.balance_margin": "only balance auto"}),
    (["system.balance_interval=5"], "ddp", {"system.balance_interval": "never re-planned"}),
    (["training.mlp_hidden_size=64", "training.mlp_num_layers=3"], "baseline",
     {"training.mlp_hidden_size": "only the mlp model", "training.mlp_num_layers": "only the mlp model"}),
    (["training.num_samples=512"], "ps", {"training.num_samples": "training.dataset is digits"}),
    (["training.dataset=synthetic", "training.data_dir=elsewhere", "training.download=false"], "baseline",
     {"training.data_dir": "read from no folder", "training.download": "never downloaded"}),
    (["training.dataset=torchvision:CIFAR10", "training.dataset_args={size: 3}"], "ps",
     {"training.dataset_args": "only a data-set factory"}),
    (["compression.pull=topk", "compression.pull_dense_every=5"], "ddp",
     {"compression.pull": "only the parameter server", "compression.pull_dense_every": "only the parameter"}),
    (["compression.pull=quantization", "compression.pull_ratio=0.1"], "ps",
     {"compression.pull_ratio": "only topk"}),
    (["compression.pull_dense_every=5"], "ps", {"compression.pull_dense_every": "every pull is dense"}),
]


@pytest.mark.parametrize(("sets", "strategy", "expected"), IGNORED)
def test_keys_a_run_ignores_are_named_with_their_reason(sets, strategy, expected):
    found = ignored(strategy, *sets)
    assert set(found) == set(expected), found
    for key, part in expected.items():
        assert part in found[key], (key, found[key])


ACTED_ON = [
    (["ps.aggregation_mode=ssp", "ps.staleness=5"], "ps"),
    (["ps.backup_workers=1"], "ps"),
    (["ps.overlap=false"], "ps"),
    (["compression.pull=topk", "compression.pull_ratio=0.1", "compression.pull_dense_every=5"], "ps"),
    (["compression.pull=topk", "ps.aggregation_mode=async", "compression.pull_dense_every=5"], "ps"),
    (["compression.pull=topk", "ps.aggregation_mode=ssp", "compression.pull_ratio=0.1"], "ps"),
    (["compression.enabled=true", "compression.type=topk", "compression.ratio=0.5"], "ddp"),
    (["compression.enabled=true", "compression.type=quantization", "compression.stochastic_rounding=true"],
     "ps"),
    (["compression.enabled=true", "compression.type=powersgd", "compression.powersgd_rank=4"], "ddp"),
    (["compression.enabled=true", "compression.type=fp16", "compression.error_feedback=false"], "ps"),
    (["training.optimizer=sgd", "training.momentum=0.5"], "baseline"),
    (["ddp.static_graph=true", "ddp.max_restarts=2"], "ddp"),
    (["coordinator.max_restarts=1", "coordinator.heartbeat_timeout=9", "coordinator.straggler_factor=3"],
     "ps"),
    (["coordinator.address=node0:50050", "coordinator.heartbeat_interval=2"], "ddp"),
    (["system.balance=auto", "system.balance_margin=0.5", "system.balance_interval=5"], "ddp"),
    (["system.num_workers=4", "system.balance=proportional", "system.balance_interval=5"], "ps"),
    (["training.model_architecture=mlp", "training.mlp_hidden_size=64"], "ps"),
    (["training.dataset=synthetic", "training.num_samples=512"], "baseline"),
    (["training.dataset=mnist", "training.data_dir=elsewhere", "training.download=false"], "ddp"),
    (["training.dataset=torchvision:CIFAR10", "training.data_dir=elsewhere", "training.download=false"],
     "baseline"),
    (["system.architecture=ddp"], "ps"),  # a command that names another strategy warns by itself
]


@pytest.mark.parametrize(("sets", "strategy"), ACTED_ON)
def test_keys_a_run_acts_on_are_not_named(sets, strategy):
    assert changed_keys(config_of(*sets))  # the keys are set away from their defaults
    assert ignored(strategy, *sets) == {}


def test_every_rule_names_keys_that_exist():
    keys = [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    for rule in RULES:
        assert any(rule.covers(key) for key in keys), rule.pattern


def test_the_line_shows_the_value_as_yaml_writes_it():
    (key,) = ignored_keys(config_of("ddp.static_graph=true"), "ps")
    assert key.line() == "ddp.static_graph = true is ignored by this run: only DDP reads the ddp section"


def test_a_comparison_is_warned_about_keys_every_run_ignores():
    config = config_of("ps.staleness=5", "training.momentum=0.5", "ddp.static_graph=true")
    ssp = config.replace(ps={"aggregation_mode": "ssp"})
    runs = [(config, "baseline"), (ssp, "ps"), (config, "ddp")]
    assert [k.key for k in ignored_by_every_run(runs)] == ["training.momentum"]
    assert ignored_by_every_run([]) == []


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="unknown strategy 'ps-sync'"):
        ignored_keys(Config(), "ps-sync")


def test_a_process_a_launcher_started_says_nothing(caplog):
    config = config_of("ps.staleness=5", "system.architecture=ddp")
    launched = {PARENT_ENV: "4242"}
    assert warn_about_run_config(config, "ps-worker", launched) == []
    assert warn_about_comparison_config([(config, "baseline")], launched) == []
    assert caplog.records == []
    lines = warn_about_run_config(config, "ps-worker", {})
    assert len(lines) == 2 and "`disttrain train --config FILE`" in lines[0] and "ps.staleness" in lines[1]
    assert [r.getMessage() for r in caplog.records] == lines
    assert all(r.levelname == "WARNING" for r in caplog.records)


def test_schedule_keys_of_another_schedule_are_ignored_with_the_schedule_named():
    config = config_from_dict({"training": {"lr_schedule": "step", "lr_gamma": 0.5, "lr_min": 1e-5}})
    ignored = {k.key: k.reason for k in ignored_keys(config, "ps")}
    assert ignored == {"training.lr_min": "only cosine and linear decay to a floor (training.lr_schedule "
                                          "is step)"}
    cosine = config.replace(training={"lr_schedule": "cosine", "lr_decay_steps": 100})
    assert [k.key for k in ignored_keys(cosine, "baseline")] == ["training.lr_gamma"]
