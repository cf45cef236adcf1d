"""The package logger: rank 0 speaks, other ranks stay quiet, and an
application's own logging configuration receives the records (the logger
propagates) instead of a second copy on stderr. No process group."""

import logging
import os

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


@pytest.mark.parametrize(
    "form, said",
    [
        # basicConfig()'s (absl's and grain's, mostly): the package's own
        # format, not a second prefix (issue 48).
        (logging.BASIC_FORMAT, "[ktd rank 0] WARNING: said once"),
        ("%(asctime)s %(message)s", "[ktd rank 0] <time> said once"),
    ],
)
def test_the_rank_prefix_survives_another_librarys_basic_config(form, said):
    """An application's (or another library's) handler on the root logger
    prints the package's records with `[ktd rank N]` in front (in the
    package's format under basicConfig's default one); other records as its
    own formatter says."""
    import io

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(form, datefmt="<time>"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        logger.warning("said once")
        logging.getLogger("another.library").warning("its own")
    finally:
        root.removeHandler(handler)
    assert stream.getvalue().splitlines() == [
        said,
        logging.Formatter(form, datefmt="<time>").format(
            logging.makeLogRecord(
                {
                    "name": "another.library",
                    "msg": "its own",
                    "levelname": "WARNING",
                }
            )
        ),
    ]


def test_warnings_are_rank_0s_and_point_at_the_users_line(monkeypatch):
    """A warning attributed to a line of the package (Keras' stacklevel
    lands in the patch table's frames) is shown at the caller's line; the
    other ranks show none unless KTD_LOG_ALL_RANKS=1."""

    from keras_torch_distribution import _log

    shown = []
    monkeypatch.setattr(
        _log,
        "_shown_by",
        lambda message, c, path, line, *_: shown.append(
            (str(message), path, line)
        ),
    )

    def show(rank):
        monkeypatch.setenv("RANK", rank)
        shown.clear()
        _log._show_warning(
            UserWarning("batch warning"),
            UserWarning,
            os.path.join(_log._PACKAGE_DIR, "_batch", "adapter.py"),
            68,
        )
        return shown

    line = show.__code__.co_firstlineno + 3  # `show`'s call of _show_warning
    assert show("0") == [("batch warning", __file__, line)]
    assert show("1") == []
    monkeypatch.setenv("KTD_LOG_ALL_RANKS", "1")
    assert show("1") == [("batch warning", __file__, line)]


def test_other_libraries_logging_is_rank_0s(monkeypatch):
    from keras_torch_distribution import _log

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    torch_level = logging.getLogger("torch").level
    root.handlers.clear()
    root.setLevel(logging.WARNING)
    try:
        monkeypatch.setenv("RANK", "1")
        _log.quiet_other_ranks()
        assert root.level == logging.ERROR
        # torch prints through a handler of its own ("CPU process group
        # does not support alltoall yet" on every rank, issue 48).
        assert logging.getLogger("torch").level == logging.ERROR
        root.setLevel(logging.WARNING)
        logging.getLogger("torch").setLevel(logging.WARNING)
        monkeypatch.setenv("RANK", "0")
        _log.quiet_other_ranks()
        assert root.level == logging.WARNING
        assert logging.getLogger("torch").level == logging.WARNING
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        logging.getLogger("torch").setLevel(torch_level)


def test_dtensors_implicit_replication_warning_is_not_shown():
    """A one-element plain tensor meeting a DTensor (a Dense(1)'s bias in
    the README's quick start) is replicated on purpose: torch's warning
    about it is filtered (here once more: pytest puts back the filters of
    before each test's collection)."""
    import warnings

    from keras_torch_distribution import _log

    with warnings.catch_warnings(record=True) as shown:
        _log.hide_expected_warnings()
        warnings.warn(
            "Found a non-scalar tensor with numel=1 and ndim!=0, we are "
            "implicitly creating a replicated DTensor for it. However, ...",
            UserWarning,
        )
        warnings.warn("another warning", UserWarning)
    assert [str(w.message) for w in shown] == ["another warning"]


def test_rank_zero_print(monkeypatch, capsys):
    import keras_torch_distribution as ktd

    monkeypatch.setenv("RANK", "1")
    ktd.rank_zero_print("from rank one")
    monkeypatch.setenv("RANK", "0")
    ktd.rank_zero_print("from rank", 0, sep=" ")
    assert capsys.readouterr().out == "from rank 0\n"
