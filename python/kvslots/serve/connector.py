"""The KV transfer config ``kvslots serve`` gives vLLM (``--kv-transfer-config``): the
KVSlotsConnector with its extra config from the flags, the YAML's host cache size and the one
after ``--``, checked by the connector's own :class:`~kvslots.config.ConnectorConfig`."""

from __future__ import annotations

import argparse
from typing import Any

from .._args import host as host_arg
from ..config.connector import GIB, ConnectorConfig, ConnectorConfigError
from ..config.loader import brief
from ..config.vllm_args import to_json
from ..errors import KVSlotsError, ServeError
from .tail import json_object, merge_over_flags

CONNECTOR_NAME = "KVSlotsConnector"
CONNECTOR_MODULE = "kvslots.vllm"


def connector_config(args: argparse.Namespace, hints: dict[str, Any], tail_cfg: dict[str, Any] | None,
                      notes: list[str]) -> dict[str, Any] | None:
    flag_extra: dict[str, Any] = {}
    if args.connector_config is not None:
        flag_extra = json_object(args.connector_config, "--connector-config")
    if args.host_cache_gb is not None:
        if "host_cache_gb" in flag_extra and flag_extra["host_cache_gb"] != args.host_cache_gb:
            raise ServeError(f"--host-cache-gb {args.host_cache_gb:g} conflicts with --connector-config "
                             f"host_cache_gb {flag_extra['host_cache_gb']}")
        flag_extra["host_cache_gb"] = args.host_cache_gb

    # The disk tier's flags (kv_connector_extra_config disk_path / disk_gb).
    for flag, key in (("disk_path", "disk_path"), ("disk_gb", "disk_gb")):
        value = getattr(args, flag, None)
        if value is not None:
            if key in flag_extra and flag_extra[key] != value:
                raise ServeError(f"--{flag.replace('_', '-')} {value} conflicts with --connector-config {key} "
                                 f"{flag_extra[key]}")
            flag_extra[key] = value
    if getattr(args, "disk_gb", None) is not None and "disk_path" not in flag_extra:
        raise ServeError("--disk-gb sizes the disk tier, which needs --disk-path")

    # Disaggregated prefill/decode: the role picks vLLM's kv_role and the connector's pd_* keys.
    kv_role = _pd_role(args, flag_extra)

    if args.no_connector:
        if kv_role != "kv_both":
            raise ServeError("--role prefill/decode runs the KVSlotsConnector, which --no-connector turns off")
        if flag_extra:
            given = "--host-cache-gb" if args.host_cache_gb is not None else "--connector-config"
            raise ServeError(f"{given} configures the KVSlotsConnector, which --no-connector turns off")
        if hints.get("host_cache_bytes"):
            notes.append("note: the YAML's kv_cache_config.host_cache_size is unused: --no-connector")
        return tail_cfg  # the user's own connector, if any, as given

    extra: dict[str, Any] = {}
    hinted = hints.get("host_cache_bytes")
    if hinted is not None:
        if hinted == 0:
            notes.append("note: the YAML's kv_cache_config.host_cache_size is 0 (no host tier in TRT-LLM); "
                         "the connector keeps its default size (--no-connector for none)")
        elif args.host_cache_gb is not None or "host_cache_gb" in flag_extra or "host_cache_blocks" in flag_extra:
            notes.append(f"note: the host cache size from the flags overrides the YAML's "
                         f"kv_cache_config.host_cache_size ({hinted} bytes)")
        else:
            extra["host_cache_gb"] = hinted / GIB
    extra.update(flag_extra)

    cfg: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": kv_role,
    }
    if tail_cfg is not None:
        name = tail_cfg.get("kv_connector")
        if name not in (None, CONNECTOR_NAME):
            raise ServeError(f"after --: --kv-transfer-config uses connector {name!r}; kvslots serve runs "
                             f"{CONNECTOR_NAME} (add --no-connector to run your own)")
        # None only: a [] or "" was taken for "no extra config" and dropped.
        tail_extra = tail_cfg.get("kv_connector_extra_config")
        tail_extra = {} if tail_extra is None else tail_extra
        if not isinstance(tail_extra, dict):
            raise ServeError("after --: --kv-transfer-config: kv_connector_extra_config must be a JSON object")
        role = tail_cfg.get("kv_role", kv_role)
        if role not in KV_ROLES:
            raise ServeError(f"after --: --kv-transfer-config: kv_role {brief(role, 80, plain=True)} is not one of "
                             f"{', '.join(KV_ROLES)}")
        if role != kv_role and (getattr(args, "role", None) or getattr(args, "is_prefill_worker", False)):
            raise ServeError(f"after --: --kv-transfer-config kv_role {role} conflicts with --role "
                             f"{'prefill' if kv_role == 'kv_producer' else getattr(args, 'role', None)}")
        flags = {k: (v, f"{k}={to_json(v)} from the kvslots serve flags") for k, v in flag_extra.items()}
        merge_over_flags(extra, tail_extra, "kv-transfer-config", flags, notes)
        for k, v in tail_cfg.items():
            if k != "kv_connector_extra_config":
                cfg[k] = v
    if "pd_host" in extra:
        # The same rule as ConnectorConfig's (_args.host), checked first so that the error
        # names the --pd-host flag where the value came from it.
        try:
            flag = " (--pd-host)" if getattr(args, "pd_host", None) is not None else ""
            host_arg(extra["pd_host"], f"kv_connector_extra_config.pd_host{flag}")
        except KVSlotsError as e:
            raise ServeError(str(e)) from None
    try:
        # check_tiers_hold_a_block: a size that holds not one byte, refused before vLLM starts
        # (the engine alone knows the bytes per block, and refused it only once loaded).
        # check_disk_path: a disk_path the disk tier cannot make or write its file in (a file,
        # /proc/self, a read-only directory), which the connector refused only once vLLM started.
        connector_config = ConnectorConfig.from_extra_config(extra)
        connector_config.check_tiers_hold_a_block()
        connector_config.check_disk_path()
    except ConnectorConfigError as e:
        if hinted and "host_cache_gb" not in flag_extra and extra.get("host_cache_gb") == hinted / GIB \
                and "host_cache_gb" in str(e):  # a key the user never wrote: say where it came from
            raise ServeError(f"{e} (from the YAML's kv_cache_config.host_cache_size, {hinted} bytes)") from None
        raise ServeError(str(e)) from None
    cfg["kv_connector_extra_config"] = extra
    if kv_role == "kv_consumer":
        # A pull that fails (prefill worker gone, layouts differ) is recomputed here.
        cfg.setdefault("kv_load_failure_policy", "recompute")
    if extra.get("disk_path") is not None:
        # A corrupt disk block is then recomputed, not a failed request.
        cfg.setdefault("kv_load_failure_policy", "recompute")
    return cfg


#: vLLM's kv_role values.
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


def _pd_role(args: argparse.Namespace, flag_extra: dict[str, Any]) -> str:
    """vLLM's kv_role for --role / --is-prefill-worker; puts pd_host / pd_port in the extra config."""
    from .cli import DEFAULT_PD_PORT

    role = getattr(args, "role", None)
    if getattr(args, "is_prefill_worker", False):
        if role not in (None, "prefill"):
            raise ServeError(f"--is-prefill-worker conflicts with --role {role}")
        role = "prefill"
    role = role or "both"
    host, port = getattr(args, "pd_host", None), getattr(args, "pd_port", None)
    if role == "both":
        if host is not None or port is not None:
            raise ServeError("--pd-host/--pd-port configure disaggregated prefill/decode: add --role prefill or decode")
        return "kv_both"
    if port is not None and role == "decode":
        raise ServeError("--pd-port is the prefill worker's control port; a decode worker learns it per request")
    for key, value in (("pd_host", host), ("pd_port", port if role == "prefill" else None)):
        if value is not None:
            if key in flag_extra and flag_extra[key] != value:
                raise ServeError(f"--{key.replace('_', '-')} {value} conflicts with --connector-config {key} "
                                 f"{flag_extra[key]}")
            flag_extra[key] = value
    if role == "prefill":
        flag_extra.setdefault("pd_port", DEFAULT_PD_PORT)
        return "kv_producer"
    return "kv_consumer"


__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "connector_config"]
