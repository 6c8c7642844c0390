"""Ray's and Tune's log messages that fedray drops: those that say nothing the user can act on, or what fedray says
in its own one line.

Each is dropped by its logger and the start of its text, inside a block only:
every other warning and error of Ray and Tune still shows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


@contextmanager
def without_messages(logger_name: str, *prefixes: str) -> Iterator[None]:
    """Inside, the messages of the logger ``logger_name`` that start with one of ``prefixes`` are dropped."""
    logger = logging.getLogger(logger_name)
    dropping = _DropMessages(prefixes)
    logger.addFilter(dropping)
    try:
        yield
    finally:
        logger.removeFilter(dropping)
