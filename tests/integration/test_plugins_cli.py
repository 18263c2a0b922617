"""A user's model and data set, defined in a file of their own, train under every strategy
from the command line; an installed package's entry points are found by name; a text
file trains gpt_small, reporting perplexity."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import yaml

from disttrain.config import load_config
from disttrain.core import checkpoint as ckpt
from disttrain.metrics.keys import PERPLEXITY_TARGETS
from disttrain.metrics.logger import read_metrics
from disttrain.training.models import init_model
from tests.plugin_files import write_plugin, write_text
from tests.unit.test_plugins import write_distribution

SMALL = ["--batch-size", "16", "--num-epochs", "1", "--num-threads", "1"]
TINY_GPT = "training.model_args={n_layer: 1, n_head: 2, n_embd: 16}"


def user_config(tmp_path, factory: str = "model", **training) -> str:
    """A config file naming the user's model (`factory` of the plug-in) and data set, with
    the model's arguments."""
    plugin = write_plugin(tmp_path)
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"training": {
        "model_architecture": f"{plugin}:{factory}", "dataset": f"{plugin}:data",
        "model_args": {"hidden": 12}, "optimizer": "sgd", "learning_rate": 0.1, **training}}))
    return str(path)


def dirs(tmp_path, name):
    return ["--checkpoint-dir", tmp_path / name / "ckpt", "--log-dir", tmp_path / name / "logs"]


def summary_of(tmp_path, name):
    return json.loads((tmp_path / name / "logs" / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_users_model_and_data_resume_exactly_mid_epoch_and_evaluate(tmp_path, cli):
    config = ["--config", user_config(tmp_path), *SMALL, "--num-epochs", "2", "--checkpoint-interval", "4"]
    whole = cli("baseline", *config, *dirs(tmp_path, "whole"))
    assert whole.returncode == 0, whole.stderr
    summary = summary_of(tmp_path, "whole")
    assert summary["dataset"].endswith("my_plugin.py:data") and summary["samples_processed"] == 2 * 192
    assert summary["final_accuracy"] > 0.75  # the sign of a sum: a broken path stays near 0.5
    killed = cli("baseline", *config, *dirs(tmp_path, "cut"), "--inject", "kill:worker=0:step=6")
    assert killed.returncode == -signal.SIGKILL
    assert ckpt.latest_checkpoint(tmp_path / "cut" / "ckpt").name == "checkpoint_step00000004.pt"  # mid-epoch
    resumed = cli("baseline", *config, *dirs(tmp_path, "cut"), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    weights = [ckpt.load_checkpoint(tmp_path / name / "ckpt" / "baseline_final.pt")["model"]
               for name in ("whole", "cut")]
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
    evaluated = cli("evaluate", "--config", user_config(tmp_path),
                    tmp_path / "whole" / "ckpt" / "baseline_final.pt")
    assert f"Test Accuracy: {summary['final_accuracy'] * 100:.2f}%" in evaluated.stdout, evaluated.stderr


@pytest.mark.slow  # a training run as a process, on a package written beside it
@pytest.mark.timeout(60)
def test_an_installed_packages_entry_points_are_found_by_name(tmp_path, cli):
    write_distribution(tmp_path / "site", """
        [disttrain.models]
        tiny-classifier = userplug.zoo:model
        [disttrain.datasets]
        tiny-vectors = userplug.zoo:data
        """)
    path = os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")]))
    result = cli("baseline", "--model", "tiny-classifier", "--dataset", "tiny-vectors", *SMALL,
                 *dirs(tmp_path, "run"), env={"PYTHONPATH": path})
    assert result.returncode == 0, result.stderr
    assert summary_of(tmp_path, "run")["samples_processed"] == 192


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.extended  # a user's model on the parameter server: the compare test below
def test_a_users_model_and_data_train_on_two_parameter_server_shards(tmp_path, cli):
    result = cli("ps", "--config", user_config(tmp_path), *SMALL, "--workers", "2", "--servers", "2",
                 *dirs(tmp_path, "ps"))
    assert result.returncode == 0, result.stderr
    summary = summary_of(tmp_path, "ps")
    assert summary["strategy"] == "ps-sync" and summary["num_servers"] == 2
    assert summary["samples_applied"] == 192 and summary["samples_lost"] == 0
    assert summary["final_accuracy"] > 0.6


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("recovery", [pytest.param("restart", marks=pytest.mark.extended), "live"])
def test_a_model_with_a_parameter_no_step_uses_needs_ddp_told_and_then_trains(tmp_path, cli, recovery):
    config = ["--config", user_config(tmp_path, "spare_head"), *SMALL, "--num-epochs", "3",
              "--world-size", "2", "--ddp-recovery", recovery]
    refused = cli("ddp", *config, *dirs(tmp_path, "refused"))
    assert refused.returncode == 2  # before any rank starts: no log folder
    assert "spare.weight" in refused.stderr and "--find-unused-parameters" in refused.stderr, refused.stderr
    assert not (tmp_path / "refused" / "logs").exists()
    told = cli("ddp", *config, "--find-unused-parameters", *dirs(tmp_path, "told"))
    assert told.returncode == 0, told.stderr
    summary = summary_of(tmp_path, "told")
    assert summary["samples_processed"] == 3 * 192 and summary["final_accuracy"] > 0.6
    spare = ckpt.load_checkpoint(tmp_path / "told" / "ckpt" / "ddp_final.pt")["model"]["spare.weight"]
    initial = init_model(load_config(config[1]).training)
    assert torch.equal(spare, initial.spare.weight.detach())  # nothing trained it


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_plugin_file_imports_the_modules_beside_it_in_every_process(tmp_path, cli):
    """Run from another folder, the parameter server's launcher, shards and workers each
    import the user's file, which imports a module of its own folder."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "layers.py").write_text("import torch.nn as nn\n\n"
                                      "def head(width, classes):\n    return nn.Linear(width, classes)\n")
    (folder / "net.py").write_text("import torch.nn as nn\n\nfrom layers import head\n\n"
                                   "def build(description):\n"
                                   "    classes = description.num_classes\n"
                                   "    return nn.Sequential(nn.Flatten(), head(64, classes))\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = cli("ps", "--dataset", "digits", "--model", folder / "net.py:build", "--max-train-samples",
                 "128", *SMALL, "--workers", "2", *dirs(tmp_path, "ps"), cwd=elsewhere)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary_of(tmp_path, "ps")["samples_applied"] == 128


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_compare_runs_a_users_model_under_baseline_ps_async_and_ddp(tmp_path, cli):
    # Its first layer frozen (random features, wide enough for the head to read), with
    # weight decay and momentum: nothing may move that layer.
    config = user_config(tmp_path, "partly_frozen", model_args={"hidden": 32}, weight_decay=0.1, momentum=0.5)
    result = cli("compare", "--config", config, *SMALL, "--workers", "2",
                 "--strategies", "baseline,ps-async,ddp", "--set", "ps.num_servers=2",
                 "--output-dir", tmp_path / "cmp", timeout=170)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "cmp" / "report.json").read_text())
    runs = {run["name"]: run for run in report["runs"]}
    assert set(runs) == {"baseline", "ps-async", "ddp"} and all(r["status"] == "ok" for r in runs.values())
    assert all(r["final_accuracy"] > 0.6 for r in runs.values())
    initial = init_model(load_config(config).training).state_dict()
    for name, final in [("baseline", "baseline_final.pt"), ("ps-async", "parameter_server_final.pt"),
                        ("ddp", "ddp_final.pt")]:
        trained = ckpt.load_checkpoint(tmp_path / "cmp" / name / "checkpoints" / final)["model"]
        assert torch.equal(trained["0.weight"], initial["0.weight"]), name
        assert torch.equal(trained["0.bias"], initial["0.bias"]), name
        assert not torch.equal(trained["2.weight"], initial["2.weight"]), name  # the head trained
    ps_summary = json.loads((tmp_path / "cmp" / "ps-async" / "logs" / "summary.json").read_text())
    assert ps_summary["strategy"] == "ps-async" and ps_summary["num_servers"] == 2
    header = next(line for line in result.stdout.splitlines() if line.startswith("run "))
    assert header.split()[:4] == ["run", "status", "acc", "t90%"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_compare_refuses_a_model_with_a_parameter_no_step_uses_before_any_run_unless_ddp_is_told(
        tmp_path, cli):
    config = ["--config", user_config(tmp_path, "spare_head"), *SMALL, "--workers", "2",
              "--strategies", "baseline,ddp"]
    refused = cli("compare", *config, "--output-dir", tmp_path / "cmp")
    assert refused.returncode == 2  # before any run starts: no folder of runs
    assert "--strategies ddp" in refused.stderr and "spare.weight" in refused.stderr, refused.stderr
    assert "--set ddp.find_unused_parameters=true" in refused.stderr
    assert not (tmp_path / "cmp").exists()
    told = cli("compare", *config, "--set", "ddp.find_unused_parameters=true",
               "--output-dir", tmp_path / "cmp", "--check-config")
    assert told.returncode == 0, told.stderr


@pytest.mark.timeout(120)
@pytest.mark.slow  # trains a language model: make test runs it
def test_gpt_small_on_a_text_file_reports_perplexity(tmp_path, cli):
    text = write_text(tmp_path)
    args = ["--model", "gpt_small", "--dataset", f"text:{text}", "--seq-len", "16", "--set", TINY_GPT]
    result = cli("baseline", *args, *SMALL, "--learning-rate", "0.01", *dirs(tmp_path, "lm"))
    assert result.returncode == 0, result.stderr
    summary = summary_of(tmp_path, "lm")
    assert summary["task"] == "language-model" and "Final Perplexity:" in result.stdout
    assert 1 < summary["final_perplexity"] < 40  # 256 untrained: it learned the text's bytes
    records = read_metrics(tmp_path / "lm" / "logs" / "baseline" / "metrics.jsonl")
    assert not any("accuracy/test" in r or "accuracy/train" in r for r in records)
    tests = [r for r in records if "perplexity/test" in r]
    assert tests[-1]["perplexity/test"] == pytest.approx(summary["final_perplexity"])
    # Time to perplexity: the training clock of the first evaluation at or below each target.
    assert summary["time_to_accuracy_s"] == {}
    def first_at_or_below(target):
        return next((r["progress/train_time_s"] for r in tests if r["perplexity/test"] <= target), None)

    assert summary["time_to_perplexity_s"] == {f"{t:g}": first_at_or_below(t) for t in PERPLEXITY_TARGETS}
    assert any(seconds is not None for seconds in summary["time_to_perplexity_s"].values())
    assert "Time to perplexity: 32 " in result.stdout
    evaluated = cli("evaluate", *args, tmp_path / "lm" / "ckpt" / "baseline_final.pt")
    assert f"Test Perplexity: {summary['final_perplexity']:.3f}" in evaluated.stdout, evaluated.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_validate_judges_a_language_model_by_its_perplexity(tmp_path, cli):
    text, output = write_text(tmp_path), tmp_path / "properties.json"
    result = cli("validate", "--model", "gpt_small", "--dataset", f"text:{text}", "--seq-len", "16",
                 "--set", TINY_GPT, "--batch-size", "8", "--epochs", "1", "--num-threads", "1",
                 "--max-train-samples", "160", "--workers", "2", "--tolerance", "0.05",
                 "--output-dir", tmp_path / "v", "--output", output, timeout=220)
    assert result.returncode == 0, result.stderr[-2000:]
    properties = json.loads(output.read_text())["properties"]
    assert "accuracies_agree" not in properties
    agree = properties["perplexities_agree"]
    assert agree["holds"] and set(agree["figures"]["final_perplexity"]) == {"baseline", "ps-sync", "ddp"}
    assert agree["figures"]["relative_spread"] <= 0.05
    for run in ("baseline", "ps_sync", "ddp"):
        matches = properties[f"{run}_checkpoint_matches_summary"]
        assert matches["holds"], (run, matches)
        assert matches["figures"]["evaluated_perplexity"] == pytest.approx(
            matches["figures"]["summary_perplexity"], rel=1e-3)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.extended  # compare: the test of a user's model above; perplexity: the tests above
def test_compare_on_a_text_file_shows_perplexity(tmp_path, cli):
    text = write_text(tmp_path)
    result = cli("compare", "--model", "gpt_small", "--dataset", f"text:{text}", "--seq-len", "16",
                 "--set", TINY_GPT, *SMALL, "--workers", "2", "--strategies", "baseline,ps-sync,ddp",
                 "--output-dir", tmp_path / "cmp", timeout=170)
    assert result.returncode == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if line.startswith("run "))
    assert header.split()[:7] == ["run", "status", "ppl", "tppl32", "tppl16", "tppl8", "tppl4"]
    assert "t90%" not in header
    report = json.loads((tmp_path / "cmp" / "report.json").read_text())
    assert all(run["final_perplexity"] > 1 for run in report["runs"]) and report["thresholds"] == []
    assert report["perplexity_targets"] == list(PERPLEXITY_TARGETS)
    for run in report["runs"]:  # the summary's times, which the report shows
        summary = json.loads((tmp_path / "cmp" / run["log_dir"] / "summary.json").read_text())
        assert run["time_to_perplexity_s"] == summary["time_to_perplexity_s"]
    # Sync PS and DDP apply the mean gradient of the same global batches: the same model.
    perplexity = {run["name"]: run["final_perplexity"] for run in report["runs"]}
    assert perplexity["ps-sync"] == pytest.approx(perplexity["ddp"], rel=1e-5)
