"""A progress display: a tqdm bar on an interactive terminal, log lines otherwise."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)


class Progress:
    """A tqdm bar on an interactive terminal; otherwise a plain log line every ~10%."""

    def __init__(self, total: int, description: str, initial: int = 0, enabled: bool = True):
        self.total = max(total, 1)
        self.count = initial
        self.description = description
        self._bar = None
        self._next_line = initial + max(self.total // 10, 1)
        self._enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=description, dynamic_ncols=True)

    def update(self, n: int = 1, **postfix: float) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)
        elif self._enabled and self.count >= self._next_line:
            self._next_line += max(self.total // 10, 1)
            extras = " ".join(f"{k}={v:.4g}" for k, v in postfix.items())
            logger.info("%s %d/%d %s", self.description, self.count, self.total, extras)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
