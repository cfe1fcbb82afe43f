"""``--client-id-header NAME``: behind a load balancer every client has its address, so
``--max-requests-per-client`` limited them all as one. With the option (off by default) a request's
client is the last item of that header (X-Forwarded-For's address the load balancer appended);
without the header, the connection's address, as before."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from test_proxy_per_client import _run, _until  # noqa: E402

from kvslots import cli  # noqa: E402
from kvslots.errors import InvalidArgumentError  # noqa: E402
from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402
from proxy_support import started  # noqa: E402,F401 - a fixture

LB = "10.0.0.9"  # every request comes from the load balancer


def _statuses(names: list[dict[str, str]], **kw) -> list[int]:
    """Statuses of one request for each of ``names``' headers, all from LB at once, limit 1."""
    async def calls(held, client_of):
        c = client_of(LB)
        first = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "hi"}, headers=names[0]))
        await _until(lambda: held.held == 1, "the first request never reached the worker")
        rest = [asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "hi"}, headers=h)) for h in names[1:]]
        await _until(lambda: held.held + sum(r.done() for r in rest) == len(names),
                     "requests neither held nor answered")
        held.go.set()
        return [r.status_code for r in await asyncio.gather(first, *rest)]

    return _run(calls, max_requests_per_client=1, **kw)


def test_clients_behind_one_address_are_told_apart_by_the_header():
    names = [{"X-Forwarded-For": "1.1.1.1"}, {"X-Forwarded-For": "2.2.2.2"}, {"X-Forwarded-For": "3.3.3.3"}]
    assert _statuses(names, client_id_header="X-Forwarded-For") == [200, 200, 200]
    assert _statuses(names) == [200, 429, 429]  # off by default: the address


def test_a_client_cannot_name_itself_before_the_balancers_item():
    # the balancer appends the address it saw; what the client put before it is not its name
    names = [{"X-Forwarded-For": "1.1.1.1"}, {"X-Forwarded-For": "9.9.9.9, 1.1.1.1"},
             {"X-Forwarded-For": "8.8.8.8,1.1.1.1"}]
    assert _statuses(names, client_id_header="x-forwarded-for") == [200, 429, 429]


def test_requests_without_the_header_are_their_address():
    assert _statuses([{}, {"X-Client": ""}, {"X-Client": "a"}], client_id_header="X-Client") == [200, 429, 200]


@pytest.mark.parametrize("name", ["", "X Client", "X-Client:", "é", "x" * 257, 5, None.__class__])
def test_create_app_refuses_a_bad_header_name(name):
    with pytest.raises(InvalidArgumentError):
        create_app(["http://p"], [DecodeWorker("http://d")], client_id_header=name)


def test_the_command_passes_the_header_or_refuses_it_in_one_line(capsys, started):
    capsys.readouterr()
    argv = ["proxy", "--prefill", "http://p:1", "--decode", "http://d:2"]
    assert cli.main([*argv, "--client-id-header", "X-Forwarded-For"]) == 0
    assert started["app"]["client_id_header"] == "X-Forwarded-For"
    started.clear()
    capsys.readouterr()
    assert cli.main([*argv, "--client-id-header", "X Bad"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--client-id-header 'X Bad' is not an HTTP header name" in err
    assert "http" not in started
