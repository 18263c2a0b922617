"""`text:FILE`: any UTF-8 text as a byte-level language-modelling data set.

FILE is a local path or any fsspec URL (`text:s3://bucket/corpus.txt`), which is read
from its copy in the data folder's cache (`data.store_cache`).

Tokens are the file's bytes (vocabulary 256, so any text and any language, no tokenizer
to ship). The stream is cut into consecutive windows of `seq_len + 1` tokens that overlap
by one: a sample's input is a window's first `seq_len` tokens and its target the same
window shifted by one. The last tenth of the windows (at least one) is the test set, a
held-out tail of the text that training never sees.
"""

from __future__ import annotations

from pathlib import Path

import torch

from disttrain.core.errors import DataError
from disttrain.data.description import DatasetDescription
from disttrain.data.mapped import subset_indices

PREFIX = "text:"
VOCAB_SIZE = 256
TEST_FRACTION = 0.1


def describe_text(seq_len: int) -> DatasetDescription:
    return DatasetDescription.language_model(VOCAB_SIZE, seq_len)


class TextWindows:
    """Windows `starts[i] .. starts[i] + seq_len` of a token stream; a batch is one gather."""

    def __init__(self, name: str, tokens: torch.Tensor, starts: torch.Tensor, seq_len: int):
        self.name = name
        self.tokens = tokens
        self.starts = starts
        self.seq_len = seq_len
        self.description = describe_text(seq_len)
        self._offsets = torch.arange(seq_len + 1)

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.seq_len,)

    @property
    def num_classes(self) -> int:
        return VOCAB_SIZE

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.batch(torch.tensor([int(index)]))
        return inputs[0], targets[0]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[self.starts[indices].unsqueeze(1) + self._offsets]
        return chunk[:, :-1], chunk[:, 1:]

    def subset(self, limit: int | None) -> TextWindows:
        keep = subset_indices(len(self), limit)
        return self if keep is None else TextWindows(self.name, self.tokens, self.starts[keep], self.seq_len)


def load_text(path: str | Path, seq_len: int, name: str | None = None) -> tuple[TextWindows, TextWindows]:
    """The train and test windows of the UTF-8 file at `path`.

    Args:
        name: the file's name in the data set's name (`text:NAME`); by default `path`'s
            (a cached copy of an object passes the object's).

    Raises:
        DataError: the file is missing, unreadable, not UTF-8, or too short for one train
            and one test window of `seq_len`.
    """
    file = Path(path)
    try:
        data = file.read_bytes()
        data.decode("utf-8")
    except OSError as e:
        raise DataError(f"training.dataset: text file {path} cannot be read ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise DataError(f"training.dataset: {path} is not UTF-8 text (byte {e.start}); save it as "
                        "UTF-8") from e
    num_windows = (len(data) - 1) // seq_len
    if num_windows < 2:
        raise DataError(f"training.dataset: {path} has {len(data)} bytes, too few for a train and a test "
                        f"window of training.seq_len={seq_len} (needs {2 * seq_len + 1}); use more text "
                        "or a smaller seq_len")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    starts = torch.arange(num_windows) * seq_len
    num_test = max(1, int(num_windows * TEST_FRACTION))
    name = f"{PREFIX}{name or file.name}"
    return (TextWindows(name, tokens, starts[:-num_test], seq_len),
            TextWindows(name, tokens, starts[-num_test:], seq_len))


SYNTHETIC_SEED = 4321
SYNTHETIC_SUCCESSORS = 4  # each byte is followed by one of 4 bytes: learnable, not trivial


def synthetic_text(num_samples: int, seq_len: int) -> tuple[TextWindows, TextWindows]:
    """`synthetic:text`: `num_samples` training windows (and a tenth as many, at least one,
    for the test) of a deterministic byte stream in which each byte is followed by one of
    a few fixed successors: shaped as `text:FILE`'s, for benchmarks, with a perplexity a
    model can bring from 256 towards `SYNTHETIC_SUCCESSORS`."""
    gen = torch.Generator().manual_seed(SYNTHETIC_SEED)
    successors = torch.randint(0, VOCAB_SIZE, (VOCAB_SIZE, SYNTHETIC_SUCCESSORS), generator=gen)
    num_test = max(1, num_samples // 10)
    length = (num_samples + num_test) * seq_len + 1
    choices = torch.randint(0, SYNTHETIC_SUCCESSORS, (length,), generator=gen).tolist()
    table, walk = successors.tolist(), [0]
    for choice in choices[1:]:  # a walk: each byte picks its successor (plain ints: fast)
        walk.append(table[walk[-1]][choice])
    tokens = torch.tensor(walk, dtype=torch.int64)
    starts = torch.arange(num_samples + num_test) * seq_len
    return (TextWindows("synthetic:text", tokens, starts[:num_samples], seq_len),
            TextWindows("synthetic:text", tokens, starts[num_samples:], seq_len))
