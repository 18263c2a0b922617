"""A model that cannot take its data is stopped before any process starts, by the one real
step every run takes first: exit code 2, the line naming what the model returned against
what the data set gives, under `baseline`, `ps` and `ddp` and in `--check-config`; and a
model whose forward returns an output object (as Hugging Face models do), a mapping or a
tuple trains to the end under each, evaluated the same way."""

import json

import pytest

MODEL = '''
from collections import OrderedDict

from torch import nn


class Output(OrderedDict):                       # as a Hugging Face ModelOutput
    def __getattr__(self, name):
        return self[name]


class Net(nn.Module):
    def __init__(self, outputs, returns):
        super().__init__()
        self.layer, self.returns = nn.Linear(64, outputs), returns

    def forward(self, x):
        logits = self.layer(x.flatten(1))
        if self.returns == "object":
            return Output(logits=logits, hidden_states=None)
        if self.returns == "dict":
            return {"logits": logits}
        return logits, x


def model(description, outputs=None, returns="object"):
    return Net(outputs or description.num_classes, returns)
'''

SMALL = ["--dataset", "digits", "--max-train-samples", "256", "--max-test-samples", "64", "--num-epochs", "1",
         "--batch-size", "32", "--num-threads", "1"]
MISMATCH = ("error: training.model_architecture: {file}:model returned 5 scores per target for 10 classes; "
            "give its last layer 10 outputs")


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "net.py"
    path.write_text(MODEL)
    return path


@pytest.mark.slow  # two processes of the command line each
@pytest.mark.parametrize("command", [["baseline"], ["ps", "--workers", "2"], ["ddp", "--world-size", "2"]])
def test_a_model_with_too_few_outputs_stops_before_any_process_with_its_line(tmp_path, cli, model_file,
                                                                           command):
    logs = tmp_path / "logs"
    args = [*command, *SMALL, "--model", f"{model_file}:model", "--set", "training.model_args={outputs: 5}",
            "--log-dir", logs, "--checkpoint-dir", tmp_path / "ckpt"]
    checked = cli(*args, "--check-config", timeout=60)
    assert checked.returncode == 2 and checked.stderr.strip().splitlines()[-1] == \
        MISMATCH.format(file=model_file), checked.stderr[-2000:]
    result = cli(*args, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == MISMATCH.format(file=model_file)
    assert "Traceback" not in result.stderr
    assert not list(logs.glob("*.log")) and not (logs / "summary.json").exists()  # nothing was started


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("command, returns", [
    (["baseline"], "tuple"),
    # an output object on the parameter server: the GPT-2 of test_hf_models; make test-extended runs it
    pytest.param(["ps", "--workers", "2", "--servers", "2"], "object", marks=pytest.mark.extended),
    (["ddp", "--world-size", "2"], "dict"),
])
def test_a_model_returning_an_output_object_a_mapping_or_a_tuple_trains_to_the_end(tmp_path, cli, model_file,
                                                                                    command, returns):
    logs = tmp_path / "logs"
    result = cli(*command, *SMALL, "--model", f"{model_file}:model", "--set",
                 f"training.model_args={{returns: {returns}}}", "--learning-rate", "0.01", "--log-dir", logs,
                 "--checkpoint-dir", tmp_path / "ckpt", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((logs / "summary.json").read_text())
    assert summary["final_accuracy"] > 0.3, summary  # it learnt, and was evaluated through its logits
