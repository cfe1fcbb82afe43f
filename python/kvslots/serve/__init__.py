"""``kvslots serve``: vLLM's OpenAI-compatible server with kvslots wired in (the plan of the vLLM
command, and the supervisor that runs it)."""

from .launcher import (
    DEFAULT_EVENTS_ENDPOINT,
    VLLM_SERVER_MODULE,
    VLLM_SHORT_OPTIONS,
    ServeError,
    ServePlan,
    build_plan,
    make_parser,
    plan_from_argv,
    scan_vllm_args,
    supervise,
)

__all__ = [
    "DEFAULT_EVENTS_ENDPOINT",
    "VLLM_SERVER_MODULE",
    "VLLM_SHORT_OPTIONS",
    "ServeError",
    "ServePlan",
    "build_plan",
    "make_parser",
    "plan_from_argv",
    "scan_vllm_args",
    "supervise",
]
