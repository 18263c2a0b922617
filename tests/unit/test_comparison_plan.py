"""Strategy names of `disttrain compare` and the commands they become."""

from pathlib import Path

import pytest

from disttrain.comparison.plan import parse_strategies
from disttrain.config import STRATEGY_OF_ARCHITECTURE, load_config
from disttrain.core.errors import ConfigError
from disttrain.core.process_spec import arguments


def test_names_become_runs_in_order_with_their_workers():
    names = "baseline, ps-sync,ps-ssp,ps-async,ddp,ps-sync+topk,ddp+powersgd,ps-async+int8"
    runs = parse_strategies(names, 4)
    assert [r.name for r in runs] == ["baseline", "ps-sync", "ps-ssp", "ps-async", "ddp", "ps-sync+topk",
                                      "ddp+powersgd", "ps-async+int8"]
    assert [r.workers for r in runs] == [1, 4, 4, 4, 4, 4, 4, 4]
    assert [r.subcommand for r in runs] == ["baseline", "ps", "ps", "ps", "ddp", "ps", "ddp", "ps"]


def test_each_run_sets_only_its_own_keys_and_turns_compression_off_unless_named():
    baseline, sync, topk, powersgd, int8 = parse_strategies(
        "baseline,ps-sync,ps-sync+topk,ddp+powersgd,ps-async+int8", 2)
    assert baseline.settings() == {"system.architecture": "baseline", "compression.enabled": "false"}
    assert sync.settings() == {"system.architecture": "parameter_server", "ps.aggregation_mode": "sync",
                               "compression.enabled": "false"}
    assert topk.settings() == {"system.architecture": "parameter_server", "ps.aggregation_mode": "sync",
                               "compression.enabled": "true", "compression.type": "topk"}
    assert powersgd.settings() == {"system.architecture": "ddp", "compression.enabled": "true",
                                   "compression.type": "powersgd"}
    assert int8.settings()["compression.type"] == "quantization"


def test_each_run_names_its_own_architecture_so_its_command_never_warns():
    base = load_config(None, {}, ["system.architecture=ddp", "compression.enabled=true"])
    for run in parse_strategies("baseline,ps-ssp,ddp+fp16", 2):
        config = run.config(base)
        assert STRATEGY_OF_ARCHITECTURE[config.system.architecture] == run.subcommand
        assert config.compression.enabled == (run.compression is not None)
    assert parse_strategies("ps-ssp", 2)[0].config(base).ps.aggregation_mode == "ssp"


def test_arguments_resolve_to_a_valid_config_with_the_run_folders(tmp_path):
    run = parse_strategies("ps-ssp+fp16", 3)[0]
    args = arguments(run.spec(tmp_path / "config.yaml", tmp_path / "ps-ssp+fp16"))
    assert args[:3] == ["ps", "--config", str(tmp_path / "config.yaml")]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    config = load_config(None, {"system.log_dir": args[args.index("--log-dir") + 1]}, sets)
    assert config.ps.aggregation_mode == "ssp" and config.system.num_workers == 3
    assert config.compression.enabled and config.compression.type == "fp16"
    assert Path(config.system.log_dir) == tmp_path / "ps-ssp+fp16" / "logs"


@pytest.mark.parametrize(("text", "says"), [
    ("baseline,ps-foo", "unknown strategy 'ps-foo'"),
    ("ps-sync+zip", "unknown strategy 'ps-sync+zip'"),
    ("baseline+topk", "the baseline sends no gradients"),
    ("ps-sync+powersgd", "ddp+powersgd"),
    ("ddp,ddp", "named twice"),
    (" , ", "no strategy named"),
])
def test_bad_names_are_refused_with_the_name_and_what_is_known(text, says):
    with pytest.raises(ConfigError, match="--strategies") as caught:
        parse_strategies(text, 2)
    assert says in str(caught.value)
