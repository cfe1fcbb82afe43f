"""uvicorn's lines a peer can trigger, bounded for both commands that serve HTTP
(:func:`kvslots._ratelog.quiet_logs`): a malformed request is a WARNING of uvicorn's each."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("uvicorn")

from kvslots import _ratelog, cli  # noqa: E402


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture
def uvicorn_error():
    """uvicorn.error with a handler recording what it writes (its level and filters are put back
    by conftest's autouse fixture)."""
    error = logging.getLogger("uvicorn.error")
    lines = _Lines()
    error.addHandler(lines)
    error.setLevel(logging.INFO)  # as uvicorn.run sets it (another test's server may have left it at ERROR)
    yield error, lines.lines
    error.removeHandler(lines)


def test_the_indexer_command_limits_uvicorns_lines(uvicorn_error, monkeypatch):
    """`kvslots indexer` logged a line per malformed request (200 of 200): the limit was the proxy's only."""
    import uvicorn

    from kvslots.indexer import cli as indexer_cli

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    monkeypatch.setattr(indexer_cli, "check_listen", lambda host, port: None)
    assert cli.main(["indexer", "--port", "8200"]) == 0
    error, lines = uvicorn_error
    for _ in range(3 * _ratelog.BURST):
        error.warning("Invalid HTTP request received.")
    assert len(lines) == _ratelog.BURST  # the old code: 30


def _raise(kind: type[Exception]) -> None:
    raise kind("a bug")


def _raise_elsewhere() -> None:
    raise ValueError("another bug of the same type")


def _log_traceback(error: logging.Logger, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:  # as uvicorn logs an app's exception
        error.error("Exception in ASGI application\n", exc_info=e)


def test_one_kind_of_traceback_does_not_hide_another(uvicorn_error):
    """Every traceback is "Exception in ASGI application": keyed on (level, template) alone, ten
    of one bug a minute (one a client can trigger) hid every other (0 of 3 ZeroDivisionErrors)."""
    error, lines = uvicorn_error
    _ratelog.quiet_logs()
    for _ in range(2 * _ratelog.BURST):
        _log_traceback(error, _raise, ValueError)
    for _ in range(3):
        _log_traceback(error, _raise, ZeroDivisionError)
    for _ in range(2):
        _log_traceback(error, _raise_elsewhere)
    text = "\n".join(lines)
    assert text.count("ValueError: a bug") == _ratelog.BURST
    assert text.count("ZeroDivisionError: a bug") == 3  # the old code: 0
    assert text.count("ValueError: another bug of the same type") == 2  # another frame: the old code, 0
    assert len(lines) == _ratelog.BURST + 5


def test_records_without_a_traceback_keep_one_allowance(uvicorn_error):
    error, lines = uvicorn_error
    _ratelog.quiet_logs()
    _ratelog.quiet_logs()  # once per logger
    for i in range(2 * _ratelog.BURST):
        error.error("ASGI callable returned without completing response. (%d)", i)
    assert len(lines) == _ratelog.BURST


def test_a_command_sets_the_loggers_and_they_are_put_back(monkeypatch):
    """A test reaching quiet_logs through a command (as test_indexer_http_hostile.py's and
    test_proxy_hostile.py's do) left uvicorn.error filtered and httpx at WARNING for the rest of
    the run; conftest's autouse fixture runs every test in loggers_kept, checked here."""
    import uvicorn

    from conftest import loggers_kept
    from kvslots.indexer import cli as indexer_cli

    httpx_log, error = logging.getLogger("httpx"), logging.getLogger("uvicorn.error")
    before = httpx_log.level, list(error.filters)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    monkeypatch.setattr(indexer_cli, "check_listen", lambda host, port: None)
    with loggers_kept():
        assert cli.main(["indexer", "--port", "8200"]) == 0
        assert httpx_log.level == logging.WARNING
        assert any(isinstance(f, _ratelog.RateLimitedRecords) for f in error.filters)
    assert (httpx_log.level, error.filters) == before
    assert not any(isinstance(f, _ratelog.RateLimitedRecords) for f in error.filters)
