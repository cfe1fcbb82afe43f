"""``kvslots serve``: vLLM's OpenAI-compatible server with kvslots wired in.

One concept per module: :mod:`.tail` (vLLM's own arguments after ``--``), :mod:`.connector` and
:mod:`.events` (the ``--kv-transfer-config`` and ``--kv-events-config`` it builds), :mod:`.plan`
(the vLLM command, :class:`ServePlan`), :mod:`.supervisor` (running it and stopping every process
it started) and :mod:`.cli` (the command line)."""

from ..errors import ServeError
from .cli import make_parser, plan_from_argv
from .events import DEFAULT_EVENTS_ENDPOINT
from .plan import VLLM_SERVER_MODULE, ServePlan, build_plan
from .supervisor import supervise
from .tail import VLLM_SHORT_OPTIONS, TailOption, scan_vllm_args

__all__ = [
    "DEFAULT_EVENTS_ENDPOINT",
    "VLLM_SERVER_MODULE",
    "VLLM_SHORT_OPTIONS",
    "ServeError",
    "ServePlan",
    "TailOption",
    "build_plan",
    "make_parser",
    "plan_from_argv",
    "scan_vllm_args",
    "supervise",
]
