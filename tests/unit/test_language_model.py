"""The language-model task: the loss is the mean cross-entropy over every token, and the
figure beside it is perplexity, exp(loss), wherever a classifier reports accuracy; and
the shipped models, gpt_small and resnet18."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from disttrain.config import TrainingConfig, config_from_dict
from disttrain.data import DatasetDescription, load_datasets
from disttrain.metrics.hparams import metric_values
from disttrain.metrics.summary import Outcome, RunSummary, Work
from disttrain.metrics.window import MetricsWindow
from disttrain.training.engine import EvalResult, evaluate, forward_backward, task_loss, train_step
from disttrain.training.models import build_for, count_parameters, init_model
from tests.plugin_files import write_text

TINY_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 16}


def test_the_loss_is_the_mean_over_every_token():
    logits, targets = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    by_token = [F.cross_entropy(logits[b, t:t + 1], targets[b, t:t + 1]) for b in range(3) for t in range(5)]
    assert torch.allclose(task_loss(logits, targets), torch.stack(by_token).mean())
    classify_logits, labels = torch.randn(4, 3), torch.tensor([0, 2, 1, 1])
    assert torch.equal(task_loss(classify_logits, labels), F.cross_entropy(classify_logits, labels))


def test_evaluation_counts_tokens_and_reports_perplexity(tmp_path):
    config = TrainingConfig(dataset=f"text:{write_text(tmp_path)}", seq_len=12,
                            model_architecture="gpt_small", model_args=TINY_GPT)
    _, test = load_datasets(config)
    model = init_model(config)
    result = evaluate(model, test, batch_size=4)
    inputs, targets = test.batch(torch.arange(len(test)))
    with torch.no_grad():
        expected = float(task_loss(model(inputs), targets))
    assert result.num_samples == len(test) and result.num_predictions == len(test) * 12
    assert result.loss == pytest.approx(expected, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=1e-5)
    assert result.perplexity == pytest.approx(256, rel=0.2)  # untrained: about uniform over bytes
    assert result.figures("language-model") == {"loss/test": result.loss,
                                                "perplexity/test": result.perplexity}
    assert EvalResult.from_sums(result.sums()) == result


@pytest.mark.slow  # 40 training steps of a small GPT: seconds; make test runs it
def test_a_small_gpt_learns_the_text(tmp_path):
    config = TrainingConfig(dataset=f"text:{write_text(tmp_path)}", seq_len=16,
                            model_architecture="gpt_small", model_args=TINY_GPT, learning_rate=0.01)
    train, test = load_datasets(config)
    model = init_model(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    before = evaluate(model, test).perplexity
    for step in range(40):
        train_step(model, optimizer, *train.batch(torch.arange(step * 8, step * 8 + 8) % len(train)))
    assert evaluate(model, test).perplexity < before / 4


def test_a_language_models_window_and_summary_report_perplexity():
    window = MetricsWindow(0.0, perplexity=True)
    window.add(2.0, 7, 4)
    window.add(1.0, 9, 4)
    scalars = window.scalars(1.0)
    assert scalars["perplexity/train"] == pytest.approx(math.exp(1.5)) and "accuracy/train" not in scalars
    assert "accuracy/train" in MetricsWindow(0.0).scalars(1.0)
    summary = RunSummary.create("baseline", config_from_dict({}), Outcome(0.4, 1.5, task="language-model"),
                                Work(samples_processed=10, steps=2, world_size=1, total_time_s=2,
                                     train_time_s=1))
    assert summary.to_dict()["final_perplexity"] == pytest.approx(math.exp(1.5))
    assert summary.to_dict()["task"] == "language-model"
    lines = summary.lines()
    assert "Final Perplexity: 4.482" in lines and not any("Accuracy" in line for line in lines)
    assert metric_values(summary)["hparam/final_perplexity"] == pytest.approx(math.exp(1.5))


def test_gpt_small_is_causal_and_about_ten_million_parameters():
    lm = DatasetDescription.language_model(256, 64)
    full = build_for("gpt_small", lm, TrainingConfig())
    assert 10_000_000 < count_parameters(full) < 11_500_000 and full.config.block_size == 64
    model = build_for("gpt_small", lm, TrainingConfig(model_args=TINY_GPT)).eval()
    tokens = torch.randint(0, 256, (2, 10))
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 10, 256)
    assert torch.equal(a[:, :6], b[:, :6]) and not torch.allclose(a[:, 6:], b[:, 6:])


def test_resnet18_has_batchnorm_and_the_small_image_stem():
    cifar = DatasetDescription.classification((3, 32, 32), 10)
    model = build_for("resnet18", cifar, TrainingConfig())
    assert count_parameters(model) == 11_173_962
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert model.stem[0].kernel_size == (3, 3) and model.stem[0].stride == (1, 1)
    small = build_for("resnet18", cifar, TrainingConfig(model_args={"width": 4}))
    assert small(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    large = build_for("resnet18", DatasetDescription.classification((3, 96, 96), 5),
                      TrainingConfig(model_args={"width": 4}))
    assert large.stem[0].kernel_size == (7, 7) and large(torch.zeros(2, 3, 96, 96)).shape == (2, 5)


def test_forward_backward_on_tokens_counts_correct_tokens():
    model = build_for("gpt_small", DatasetDescription.language_model(256, 8),
                      TrainingConfig(model_args=TINY_GPT))
    inputs, targets = torch.randint(0, 256, (3, 8)), torch.randint(0, 256, (3, 8))
    result = forward_backward(model, inputs, targets)
    assert result.num_samples == 3 and 0 <= result.num_correct <= 24
    assert all(p.grad is not None for p in model.parameters())


def test_compares_table_shows_perplexity_for_language_models():
    from disttrain.metrics.time_to_target import ACCURACY, PERPLEXITY
    from disttrain.report.table import legend, markdown_table

    def row(name, perplexity):
        return {"name": name, "status": "ok", "final_accuracy": 0.3, "final_perplexity": perplexity,
                "time_to_accuracy_s": {"0.90": 1.5}, "time_to_perplexity_s": {"16": 2.5},
                "total_time_s": 2.0, "samples_per_s": 100.0, "speedup": 1.0,
                "scaling_efficiency": 1.0, "bytes_per_step": 0, "compression_ratio": None,
                "recovery_events": 0}

    perplexity = PERPLEXITY.with_targets([16, 8])
    table = markdown_table([row("baseline", 12.3456), row("ddp", 13.5)], perplexity)
    assert table.splitlines()[0].startswith("| run | status | ppl | tppl16 | tppl8 | total |")
    assert "| baseline | ok | 12.346 | 2.50s | - |" in table
    assert "ppl: test perplexity" in legend(perplexity) and "tpplN:" in legend(perplexity)
    classifier = markdown_table([row("baseline", None)], ACCURACY.with_targets([0.9]))
    assert "| run | status | acc | t90% |" in classifier
    assert "| baseline | ok | 30.00% | 1.50s |" in classifier
    assert "ppl" not in legend(ACCURACY)
