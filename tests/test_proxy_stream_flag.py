"""``stream`` is read as vLLM reads it (``bool | None``, pydantic's lax rules): the proxy read it by
truth, so ``"stream": "false"`` (False to vLLM, which answers whole) took the proxy's stream
path, where the answer is not bounded by ``--timeout`` in all (a worker trickling it past the
timeout was passed on for as long as it kept sending)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from kvslots.proxy.app import DecodeWorker, create_app  # noqa: E402


@pytest.mark.parametrize("value, streams", [(True, True), ("true", True), ("yes", True), (1, True), (1.0, True),
                                            (False, False), ("false", False), ("0", False), ("off", False),
                                            (0, False), (None, False), (2, False), ("", False), ([1], False),
                                            ({"a": 1}, False)])
def test_stream_is_read_as_vllm_reads_it(value, streams):
    from kvslots.proxy.app import _streams

    assert _streams({"stream": value}) is streams


def test_a_false_stream_spelled_as_a_string_is_bounded_by_the_timeout():
    async def backend(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("kv_transfer_params", {}).get("do_remote_decode"):
            return httpx.Response(200, json={"kv_transfer_params": {"do_remote_prefill": True}})

        async def trickle():  # each part well within the timeout, all of them past it
            for part in (b'{"a"', b": ", b"1", b"}"):
                await asyncio.sleep(0.4)
                yield part
        return httpx.Response(200, content=trickle(), headers={"content-type": "application/json"})

    app = create_app(["http://p"], [DecodeWorker("http://d")], transport=httpx.MockTransport(backend), timeout_s=1.0)
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "stream": "false"})
    assert r.status_code == 502 and "no whole answer within 1 s" in r.json()["error"]  # the old code: 200


_STREAM_VALUES = [True, False, None, 1, 0, 1.0, 0.0, 0.5, 2, -1, "true", "false", "True", "FALSE", "tRuE", " true",
                  "true ", "1", "0", "yes", "no", "y", "n", "on", "off", "t", "f", "", "1.0", "0.0", [], {}, [1],
                  10**30, "x" * 5000]


def test_stream_is_read_as_vllms_own_request_models_read_it():
    """The proxy's reading against vLLM's CompletionRequest and ChatCompletionRequest (in the venv):
    streamed exactly when vLLM streams; a value vLLM refuses (its 400) is not streamed."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        pytest.skip(f"vLLM is not installed ({e}): nothing to compare with")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from kvslots.proxy.app import _request_doc, _streams

    differ = []
    for value in _STREAM_VALUES:
        got = _streams(_request_doc(json.dumps({"prompt": "hi", "stream": value}).encode()))
        for model, fields in ((CompletionRequest, {"prompt": "hi"}),
                              (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})):
            try:
                want = model.model_validate({**fields, "stream": value}).stream is True
            except ValueError:  # pydantic's ValidationError: vLLM's 400
                want = False
            if got is not want:
                differ.append((model.__name__, repr(value)[:40], got, want))
    assert differ == []
