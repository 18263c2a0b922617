"""What a data set is, as a model factory and the training step need to know it: its task,
the shape of one input (or the vocabulary and sequence length of a token stream) and its
number of classes.

The task decides the loss and the figure reported beside it: classification reports
accuracy; a language model reports perplexity, exp(mean token cross-entropy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CLASSIFICATION = "classification"
LANGUAGE_MODEL = "language-model"
TASKS = (CLASSIFICATION, LANGUAGE_MODEL)


@dataclass(frozen=True)
class DatasetDescription:
    """A data set's task and shapes.

    Classification: `input_shape` is one sample's shape (e.g. (3, 32, 32)), targets are
    class indices in [0, num_classes). Language model: inputs are (seq_len,) int64 token
    ids in [0, vocab_size), targets the same positions' next tokens; `num_classes` is
    `vocab_size`.
    """

    task: str
    num_classes: int
    input_shape: tuple[int, ...] = ()
    vocab_size: int | None = None
    seq_len: int | None = None

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task {self.task!r} must be one of {', '.join(TASKS)}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes {self.num_classes} must be >= 1")
        if self.task == LANGUAGE_MODEL and not (self.vocab_size and self.seq_len):
            raise ValueError("a language-model data set needs vocab_size and seq_len")

    @classmethod
    def classification(cls, input_shape: tuple[int, ...], num_classes: int) -> DatasetDescription:
        return cls(CLASSIFICATION, int(num_classes), tuple(int(d) for d in input_shape))

    @classmethod
    def language_model(cls, vocab_size: int, seq_len: int) -> DatasetDescription:
        return cls(LANGUAGE_MODEL, int(vocab_size), (int(seq_len),), int(vocab_size), int(seq_len))

    @classmethod
    def coerce(cls, value: Any, where: str) -> DatasetDescription:
        """A description from what a data-set factory returned: a `DatasetDescription` or a
        mapping with its fields (`task`, `input_shape` or `vocab_size` + `seq_len`,
        `num_classes`).

        Raises:
            ValueError: naming `where`, when the fields are missing or wrong.
        """
        if isinstance(value, DatasetDescription):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: the description is a {type(value).__name__}; return a "
                             "DatasetDescription or a dict with task, input_shape or vocab_size and "
                             "seq_len, num_classes")
        fields = dict(value)
        task = fields.get("task", CLASSIFICATION)
        if task not in TASKS:
            raise ValueError(f"{where}: task {task!r} must be one of {', '.join(TASKS)}")
        try:
            if task == LANGUAGE_MODEL:
                return cls.language_model(fields["vocab_size"], fields["seq_len"])
            return cls.classification(tuple(fields["input_shape"]), fields["num_classes"])
        except KeyError as e:
            raise ValueError(f"{where}: the description of a {task} data set lacks {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: bad description {fields}: {e}") from e
