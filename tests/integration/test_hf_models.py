"""A Hugging Face model trains as it comes under every strategy from the command line: a
user's file builds GPT-2 (`GPT2LMHeadModel` from a `GPT2Config`, no weights to download)
for a byte-level text, whose forward returns an output object with `logits`, whose
language-model head shares its weights with the token embedding, and whose dropout is on.
The baseline, a synchronous parameter server of two workers over two shards and DDP of
two ranks each lower its perplexity; one synchronous worker trains the baseline's very
model (the same dropout masks, the tied weights updated once). BERT
(`BertForSequenceClassification` from a `BertConfig`) learns from rows of fields of
different lengths, padded (`training.collate_fn=pad`), with its own loss
(`training.loss=model`)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from disttrain.core.checkpoint import load_checkpoint
from disttrain.metrics.logger import read_metrics
from tests.plugin_files import write_text

# Looked up, not imported: collecting the suite (the fast selection too, which runs none of
# these) then pays no second for transformers; the runs import it in their own processes.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install 'disttrain[hf]')")

# Written as a user would: the factory takes the data set's description, sizes GPT-2 to its
# vocabulary (the text's 256 bytes) and sequence length, and returns the model unchanged.
HF_MODELS_SOURCE = '''
from transformers import GPT2Config, GPT2LMHeadModel


def gpt2(description, n_embd=32, n_layer=2, n_head=2):
    # Bytes only: no special tokens (GPT-2's own ids lie past a vocabulary of 256).
    config = GPT2Config(vocab_size=description.vocab_size, n_positions=description.seq_len,
                        n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                        bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(config)
'''

SEQ_LEN = 16
UNTRAINED_PERPLEXITY = 256  # a uniform guess over the byte vocabulary
# Each strategy: its command line, the folder of its first training process's metrics and
# the name of its final model.
STRATEGIES = {
    "baseline": (("baseline",), "baseline", "baseline_final.pt"),
    "ps-sync": (("ps", "--workers", "2", "--servers", "2", "--aggregation-mode", "sync"), "worker0",
                "parameter_server_final.pt"),
    "ddp": (("ddp", "--world-size", "2"), "rank0", "ddp_final.pt"),
}


SMALL = ["--batch-size", "16", "--num-threads", "1"]


def gpt2_on_a_text(tmp_path) -> list:
    """The flags naming the user's GPT-2 file and a text file (a few KB), both written here."""
    model_file = tmp_path / "hf_models.py"
    model_file.write_text(HF_MODELS_SOURCE)
    text = write_text(tmp_path)
    return ["--model", f"{model_file}:gpt2", "--dataset", f"text:{text}", "--seq-len", SEQ_LEN]


def train(cli, tmp_path, name, command, args):
    """Run `command` with `args` into tmp_path/name; assert it succeeded, return its summary."""
    result = cli(*command, *args, "--log-dir", tmp_path / name / "logs",
                 "--checkpoint-dir", tmp_path / name / "ckpt", timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Final Perplexity:" in result.stdout
    return json.loads((tmp_path / name / "logs" / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(240)
# baseline and ps-sync: the GPT-2 of test_one_synchronous_worker_trains_the_baselines_gpt2
@pytest.mark.parametrize("strategy", [pytest.param(s, marks=pytest.mark.extended) if s != "ddp" else s
                                      for s in STRATEGIES])
def test_gpt2_from_transformers_trains_under_every_strategy(tmp_path, cli, strategy):
    command, first_process, final_model = STRATEGIES[strategy]
    model_and_data = gpt2_on_a_text(tmp_path)
    summary = train(cli, tmp_path, strategy, command,
                    [*model_and_data, *SMALL, "--num-epochs", "2", "--learning-rate", "0.01"])
    assert summary["task"] == "language-model" and summary["epochs"] == 2
    assert math.isfinite(summary["final_loss"])
    assert 1 < summary["final_perplexity"] < UNTRAINED_PERPLEXITY
    records = read_metrics(tmp_path / strategy / "logs" / first_process / "metrics.jsonl")
    perplexities = [r["perplexity/test"] for r in records if "perplexity/test" in r]
    assert len(perplexities) == 2, perplexities  # one evaluation per epoch
    assert perplexities[-1] < perplexities[0], perplexities
    assert perplexities[-1] == pytest.approx(summary["final_perplexity"])
    if strategy == "ps-sync":
        assert summary["num_servers"] == 2 and summary["samples_lost"] == 0
    # The saved model is the one reported: the tied head and embedding load back as one.
    saved = load_checkpoint(tmp_path / strategy / "ckpt" / final_model)["model"]
    torch.testing.assert_close(saved["lm_head.weight"], saved["transformer.wte.weight"], rtol=0, atol=0)
    evaluated = cli("evaluate", *model_and_data, tmp_path / strategy / "ckpt" / final_model)
    assert f"Test Perplexity: {summary['final_perplexity']:.3f}" in evaluated.stdout, evaluated.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_one_synchronous_worker_trains_the_baselines_gpt2(tmp_path, cli):
    """With SGD, 20 steps of GPT-2 (dropout 0.1 everywhere) on one parameter-server worker end
    where the baseline ends: the worker draws the baseline's dropout masks, and the shard
    updates the tied embedding once per step, as the baseline's optimizer does."""
    args = [*gpt2_on_a_text(tmp_path), *SMALL, "--num-epochs", "1", "--max-train-samples", "320",
            "--optimizer", "sgd", "--learning-rate", "0.5", "--seed", "3"]
    baseline = train(cli, tmp_path, "baseline", ("baseline",), args)
    ps = train(cli, tmp_path, "ps", ("ps", "--workers", "1", "--aggregation-mode", "sync"), args)
    assert baseline["steps"] == ps["steps"] == 20
    assert ps["final_loss"] == pytest.approx(baseline["final_loss"], rel=1e-6, abs=0)
    expected = load_checkpoint(tmp_path / "baseline" / "ckpt" / "baseline_final.pt")["model"]
    trained = load_checkpoint(tmp_path / "ps" / "ckpt" / "parameter_server_final.pt")["model"]
    assert trained.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(trained[key], value, rtol=0, atol=1e-6,
                                   msg=lambda m, k=key: f"parameter server vs baseline, {k}: {m}")


# BERT as users have it: rows of fields from a `datasets`-style data set (token ids of
# different lengths, an attention mask, labels), padded into batches, given to forward as
# keyword arguments, with the loss the model computes itself from `labels=`.
HF_BERT_SOURCE = '''
import torch
from transformers import BertConfig, BertForSequenceClassification


class Rows(torch.utils.data.Dataset):
    """[CLS] (id 1) then 3 to 9 tokens; the label says whether token 7 is among them."""

    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(count):
            length = int(torch.randint(3, 10, (1,), generator=generator))
            ids = torch.cat([torch.tensor([1]), torch.randint(2, 16, (length,), generator=generator)])
            self.rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                              "labels": int((ids == 7).any())})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


def rows():
    return Rows(256, 0), Rows(64, 1), {"task": "classification", "input_shape": [10], "num_classes": 2}


def bert(description):
    config = BertConfig(vocab_size=16, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=description.num_classes)
    return BertForSequenceClassification(config)
'''


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["baseline", pytest.param("ps-sync", marks=pytest.mark.extended),
                                      pytest.param("ddp", marks=pytest.mark.extended)])
def test_bert_from_transformers_trains_on_padded_rows_with_its_own_loss(tmp_path, cli, strategy):
    command, _, final_model = STRATEGIES[strategy]
    model_file = tmp_path / "hf_bert.py"
    model_file.write_text(HF_BERT_SOURCE)
    result = cli(*command, "--model", f"{model_file}:bert", "--dataset", f"{model_file}:rows", *SMALL,
                 "--set", "training.collate_fn=pad", "--set", "training.loss=model", "--num-epochs", "3",
                 "--learning-rate", "0.005", "--log-dir", tmp_path / "logs",
                 "--checkpoint-dir", tmp_path / "ckpt", timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["samples_processed"] == 3 * 256 and summary["final_loss"] < math.log(2), summary  # learnt
    saved = load_checkpoint(tmp_path / "ckpt" / final_model)["model"]
    assert saved["classifier.weight"].shape == (2, 32)


@pytest.mark.slow
@pytest.mark.timeout(240)
# fit: test_python_api; GPT-2: the tests above
@pytest.mark.parametrize("strategy", [pytest.param("baseline", marks=pytest.mark.extended),
                                      pytest.param("ddp", marks=pytest.mark.extended)])
def test_gpt2_trains_through_the_python_api(tmp_path, strategy):
    """`disttrain.fit` with the user's file named as the command line names it, GPT-2 on a
    text: the run's summary comes back, its perplexity below a uniform guess's."""
    import disttrain

    model_file = tmp_path / "hf_models.py"
    model_file.write_text(HF_MODELS_SOURCE)
    text = write_text(tmp_path)
    summary = disttrain.fit(f"{model_file}:gpt2", f"text:{text}", strategy=strategy, workers=2, epochs=1,
                            seq_len=SEQ_LEN, batch_size=16, num_threads=1, learning_rate=0.01,
                            log_dir=tmp_path / "logs", checkpoint_dir=tmp_path / "ckpt")
    assert summary.strategy == strategy and summary.extra["task"] == "language-model"
    assert 1 < summary.extra["final_perplexity"] < UNTRAINED_PERPLEXITY
