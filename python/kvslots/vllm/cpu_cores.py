"""vLLM's CPU backend reserves one more core per worker rank whenever *any* KV connector is
configured (``vllm.utils.ompmultiprocessing.OMPProcessManager``: "reserve one more core for
nixl_connector under p/d case"), so the workers' OpenMP threads get fewer cores than without a
connector. The KVSlotsConnector runs no thread of its own: its copies run on the worker's own
thread, between forwards. On a small machine the reservation is what a connector costs: on 2
cores, vLLM cannot reserve 2 and then reserves none, so the worker's 2 OpenMP threads compete
with the engine core's busy loop and the API server (the served benchmark lost 13-80% of its
output tokens/s to it, depending on the machine's load).

``VLLM_CPU_NUM_OF_RESERVED_CPU`` overrides the count. :func:`connector_cpu_env` gives the value
vLLM uses without a connector; ``kvslots serve`` sets it unless the environment already does,
and the connector warns at start-up when it runs on the CPU backend without it.

Nothing here imports vLLM.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping

from .._args import integer, text
from ..errors import ArgumentTypeError

RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"

_PER_RANK_MACHINES = ("x86_64", "amd64", "i386", "i686", "aarch64", "arm64", "riscv64")
#: Most worker ranks on one machine these take (far beyond any machine): a 5000-digit count
#: was a ValueError when the warning printed it.
MAX_LOCAL_WORLD_SIZE = 1 << 20


def reserved_cpus_without_connector(local_world_size: int, machine: str | None = None) -> int:
    """The cores vLLM 0.32's CPU backend reserves for the engine core when no KV connector is
    configured: one per local worker rank on x86, ARM and RISC-V, one in all on other machines.
    A count that is not an int in [0, 2**20] or a machine that is not text is a kvslots error."""
    local_world_size = integer(local_world_size, "local_world_size", 0, MAX_LOCAL_WORLD_SIZE)
    m = (text(machine, "machine") if machine is not None else platform.machine()).lower()
    return max(1, local_world_size) if m in _PER_RANK_MACHINES else 1


def vllm_is_cpu_build() -> bool:
    """True when the installed vLLM is a CPU build (the ``vllm-cpu`` distribution, or a
    ``+cpu`` version), read from the package metadata without importing vLLM."""
    from importlib import metadata

    for name in ("vllm-cpu", "vllm_cpu"):
        try:
            metadata.distribution(name)
            return True
        except metadata.PackageNotFoundError:
            pass
    try:
        return "+cpu" in metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return False


def connector_cpu_env(local_world_size: int = 1, environ: Mapping[str, str] | None = None,
                      machine: str | None = None) -> dict[str, str]:
    """The environment to add to a vLLM CPU server with the KVSlotsConnector so that its workers
    keep the cores they have without a connector; empty when the variable is already set."""
    env = os.environ if environ is None else environ
    if not isinstance(env, Mapping):
        raise ArgumentTypeError(f"environ must be a mapping of variable names to values, got {type(env).__name__}")
    local_world_size = integer(local_world_size, "local_world_size", 0, MAX_LOCAL_WORLD_SIZE)
    if env.get(RESERVED_CPU_ENV, "") != "":
        return {}
    return {RESERVED_CPU_ENV: str(reserved_cpus_without_connector(local_world_size, machine))}


def reservation_warning(local_world_size: int, environ: Mapping[str, str] | None = None) -> str | None:
    """A warning for the connector to log on the CPU backend when the reservation is not set."""
    add = connector_cpu_env(local_world_size, environ)
    if not add:
        return None
    (k, v), = add.items()
    return (f"kvslots: vLLM's CPU backend reserved one more core per rank for the KV connector, "
            f"which the KVSlotsConnector does not use (its copies run on the worker's thread): the "
            f"workers' OpenMP threads lost a core. Start vLLM with {k}={v} ('kvslots serve' does).")
