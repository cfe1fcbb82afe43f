"""Fixtures of the proxy's command tests, in one home."""

from __future__ import annotations

import pytest


@pytest.fixture
def started(monkeypatch) -> dict:
    """``kvslots proxy`` run without serving: what create_app was given (``app``) and uvicorn.run's
    options (nothing is started, no address checked). The loggers the command sets
    (:func:`kvslots._ratelog.quiet_logs`) are put back by conftest's autouse fixture."""
    import uvicorn

    from kvslots import _listen
    from kvslots.proxy import app as app_module

    given: dict = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: given.update(kw))
    monkeypatch.setattr(_listen, "check_listen", lambda host, port: None)
    real = app_module.create_app
    monkeypatch.setattr(app_module, "create_app", lambda *a, **kw: given.update(app=kw) or real(*a, **kw))
    return given
