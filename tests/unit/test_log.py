"""The package logger: rank 0 speaks, other ranks stay quiet, and an
application's own logging configuration receives the records (the logger
propagates) instead of a second copy on stderr. No process group."""

import logging

import pytest

from keras_torch_distribution._log import logger


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def root_handler():
    root = logging.getLogger()
    handler = _Collect()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


def test_records_reach_the_applications_handlers_once(root_handler, capsys):
    logger.warning("checking %s", "propagation")
    assert [r.getMessage() for r in root_handler.records] == [
        "checking propagation"
    ]
    assert root_handler.records[0].rank == 0
    assert "checking propagation" not in capsys.readouterr().err


def test_without_logging_configured_the_package_prints_with_its_rank(capsys):
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()  # pytest's own capture handlers
    try:
        logger.warning("said by %s", "rank 0")
    finally:
        root.handlers[:] = saved
    assert "[ktd rank 0] WARNING: said by rank 0" in capsys.readouterr().err


def test_other_ranks_are_quiet_unless_asked(root_handler, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    logger.warning("from rank one")
    assert root_handler.records == []
    monkeypatch.setenv("KTD_LOG_ALL_RANKS", "1")
    logger.warning("from rank one, asked")
    assert [r.rank for r in root_handler.records] == [1]
