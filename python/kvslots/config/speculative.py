"""Model references and speculative configs: the one home of both decisions.

A *model reference* names a target, a draft or a verifier: ``kvslots serve``'s MODEL, a
speculative config's ``model``, a TRT-LLM ``speculative_model_dir``, a speculators checkpoint's
``verifier.name_or_path``. :func:`classify_model` says what it is (a :class:`ModelRef`):

* ``"dir"``: an existing local directory (a relative name is looked up under ``base``, by default
  the working directory). Its config.json, when readable, tells a speculators checkpoint
  (``speculators_config``) and an EAGLE / EAGLE-3 draft apart (:attr:`ModelRef.draft_method`);
* ``"not_dir"``: an existing path that is not a directory;
* ``"hub"``: nothing there locally, and a well-formed Hugging Face Hub id (``name`` or
  ``org/name``), which vLLM looks up itself;
* ``"missing"``: nothing there locally, and no Hub id is spelled so (it starts with ``/``, ``./``,
  ``../`` or ``~``, has more than one ``/``, a ``..``, a part past 96 characters, or a character
  Hub ids do not have), or the empty string: a path that does not exist. A name the system
  cannot look up (``~`` of no user, a component past 255 bytes) names nothing there.

A local path is looked up with ``~`` expanded, and vLLM gets it expanded
(:attr:`ModelRef.argument`): vLLM and Hugging Face do not expand ``~`` themselves.

:func:`resolve_speculative_config` gives the dict vLLM takes as ``--speculative-config`` from a
base config (a speculators checkpoint's or a converted TRT-LLM YAML's) and an explicit one, and
validates it: ``num_speculative_tokens`` given, an integer >= 1, a dynamic schedule that fits it, a
draft model that is a local directory or a Hub id.
"""

from __future__ import annotations

import difflib
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ArgumentTypeError, ConfigError
from .loader import brief as short
from .loader import check_values, expand_home, load_json, text_problem
from .schedule import DynamicSDSchedule

#: speculators_model_type -> (vLLM method, extra speculative-config keys). Mirrors the types
#: vLLM 0.32's speculators loader accepts (eagle3, peagle, dflash, dflash2, dspark).
SPECULATORS_METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "eagle3": ("eagle3", {}),
    "peagle": ("eagle3", {"parallel_drafting": True}),
    "dflash": ("dflash", {}),
    "dflash2": ("dflash", {}),
    "dspark": ("dspark", {}),
}

#: Methods whose drafter reads the token after a block at the block's last position, so vLLM
#: recomputes the last block of a prefix hit (vLLM 0.32's ``SpeculativeConfig.use_eagle()``).
EAGLE_BLOCK_DROP_METHODS = ("eagle", "eagle3", "mtp", "dflash", "dspark")


def drops_eagle_block(spec: Mapping[str, Any] | None) -> bool:
    """Whether vLLM drops the last block of a prefix hit under this speculative config (its
    ``use_eagle_block_drop()``): an EAGLE-family method and no ``disable_eagle_block_drop``."""
    if not spec:
        return False
    return spec.get("method") in EAGLE_BLOCK_DROP_METHODS and not spec.get("disable_eagle_block_drop")


#: A Hugging Face Hub model id: ``name`` or ``org/name``, each part at most 96 ASCII characters
#: (the Hub's limit). Matched whole (:func:`is_hub_id`): a trailing newline is not an id.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?", re.ASCII)

#: Keys of a speculators checkpoint's speculative config that an explicit one may not change.
CHECKPOINT_LOCKED_KEYS = ("method", "model")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is spelled like a Hugging Face Hub model id (``org/name``, no ``..``)."""
    return isinstance(name, str) and HUB_ID.fullmatch(name) is not None and ".." not in name


def reference_text(name: Any, what: str, kind: str = "a path or a Hub id") -> str:
    """A model reference as text: a str or an ``os.PathLike`` of one; a ConfigError otherwise."""
    try:
        text = os.fspath(name)
    except Exception:  # TypeError, or whatever a PathLike's own __fspath__ raises
        text = None
    if not isinstance(text, str):
        raise ConfigError(f"{what} must be {kind} (a string), got {type(name).__name__} {short(name)}")
    return text


def _local_path(text: str) -> Path:
    """``text`` as a local path, ``~`` expanded (:func:`~kvslots.config.loader.expand_home`: a
    ``~name`` of no user, or one holding a NUL, stays as written and names nothing)."""
    return Path(expand_home(text))


def _kind_on_disk(path: Path) -> str | None:
    """``"dir"``, ``"file"`` (a regular one), ``"other"`` (a FIFO, a device, ...) or ``None``:
    nothing there, or a name the system cannot look up (a component past 255 bytes, a NUL, a
    symlink loop, no permission)."""
    try:
        st = path.stat()
    except (OSError, ValueError):
        return None
    return "dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"


def read_model_config(
    model_dir: str | os.PathLike[str], what: str = "model"
) -> tuple[Path, dict[str, Any], str]:
    """(absolute directory, its config.json object, the file's path). Raises
    :class:`~kvslots.ConfigError` naming the directory or file (``what`` names the directory's
    role in the messages) when it is not a directory or the file is missing, unreadable, not JSON
    or not an object."""
    text = reference_text(model_dir, what)
    path = _local_path(text)
    if not text or _kind_on_disk(path) != "dir":  # "" is Path("."), but names no directory
        raise ConfigError(f"{what} {str(path) if text else text!r} is not a directory")
    cfg_path = path / "config.json"
    source = str(cfg_path)
    if not os.path.lexists(cfg_path):  # one that is there but no file (a FIFO, a loop): the reader says what
        raise ConfigError(f"no config.json in the {what} directory", source=str(path))
    doc = load_json(cfg_path)  # the limits and rules of kvslots.config.loader
    if not isinstance(doc, dict):
        raise ConfigError(f"config.json must be a JSON object, got {type(doc).__name__}", source=source)
    return path.resolve(), doc, source


@dataclass(frozen=True)
class ModelRef:
    """What a model reference names (see the module docstring)."""

    name: str
    """The reference as given."""
    kind: str
    """``"dir"``, ``"not_dir"``, ``"hub"`` or ``"missing"``."""
    path: str
    """The local path looked at (absolute; resolved for a ``"dir"``)."""
    has_config: bool = False
    """A ``"dir"`` with a config.json file."""
    config: dict[str, Any] | None = None
    """That config.json's object, ``None`` when it is absent or unreadable."""

    @property
    def is_local(self) -> bool:
        return self.kind == "dir"

    @property
    def argument(self) -> str:
        """The reference as vLLM is to get it: as given, but a local directory named with ``~``
        given expanded. vLLM and Hugging Face take ``~`` literally: ``~/model``, found here as a
        directory, was passed on as written and refused there as an invalid Hub id."""
        if self.kind == "dir" and self.name.startswith("~"):
            return str(_local_path(self.name))
        return self.name

    @property
    def is_speculators(self) -> bool:
        """A local directory whose config.json has ``speculators_config``."""
        return self.config is not None and self.config.get("speculators_config") is not None

    @property
    def draft_method(self) -> tuple[str, str] | None:
        """(vLLM method, the evidence) a local draft's config.json gives: a speculators
        checkpoint's type, EAGLE-3 fields or architectures, an EAGLE architecture; ``None``
        when it says nothing (or there is no readable config.json)."""
        doc = self.config
        if doc is None:
            return None
        smt = doc.get("speculators_model_type")
        if doc.get("speculators_config") is not None and isinstance(smt, str) and smt in SPECULATORS_METHODS:
            return SPECULATORS_METHODS[smt][0], f"speculators_model_type={smt}"
        # Only strings are evidence: a config.json with other types says nothing.
        raw_archs = doc.get("architectures")
        archs = [a.lower() for a in raw_archs if isinstance(a, str)] if isinstance(raw_archs, list) else []
        mtype = doc.get("model_type")
        mtype = mtype.lower() if isinstance(mtype, str) else ""
        if any("eagle3" in a for a in archs) or "eagle3" in mtype \
                or "eagle_aux_hidden_state_layer_ids" in doc or "draft_vocab_size" in doc:
            return "eagle3", "EAGLE-3 fields in its config.json"
        if any("eagle" in a for a in archs) or mtype == "eagle":
            return "eagle", "EAGLE architecture in its config.json"
        return None


def classify_model(name: str | os.PathLike[str], *, base: str | os.PathLike[str] | None = None) -> ModelRef:
    """What ``name`` refers to; a relative name is looked up under ``base`` (default: the working
    directory). Reads only the local config.json; never raises for what it finds (a name the
    system cannot look up, such as ``~nosuchuser/x`` or a component past 255 bytes, names nothing
    there). A ``name`` that is not a string is a :class:`~kvslots.ConfigError`."""
    text = reference_text(name, "a model reference")
    if base is not None:  # Path(base) of an int was a TypeError
        reference_text(base, "base", "a directory path")
    if not text:  # Path("") is the working directory; an empty reference names nothing
        return ModelRef(text, "missing", "")
    expanded = _local_path(text)
    candidate = expanded if expanded.is_absolute() or base is None else Path(base) / expanded
    found = _kind_on_disk(candidate)
    if found in ("file", "other"):
        return ModelRef(text, "not_dir", str(candidate.absolute()))
    if found == "dir":
        has_config = _kind_on_disk(candidate / "config.json") == "file"
        config = None
        if has_config:
            try:
                _, config, _ = read_model_config(candidate)
            except ConfigError:
                config = None
        return ModelRef(text, "dir", str(candidate.resolve()), has_config, config)
    kind = "hub" if is_hub_id(text) else "missing"
    return ModelRef(text, kind, str(candidate.absolute()))


def is_speculators_checkpoint(model_dir: str | os.PathLike[str]) -> bool:
    """Whether ``model_dir`` is a local directory whose config.json has ``speculators_config``."""
    return classify_model(model_dir).is_speculators


#: The most draft tokens per step (``num_speculative_tokens``, K) kvslots gives vLLM. vLLM's
#: config checks only ``> 0``, but its rejection sampler verifies at most 128 draft tokens per
#: request in a step (``vllm.v1.sample.rejection_sampler.MAX_SPEC_LEN``, asserted there): a larger
#: K passed vLLM's config and could fail only in the engine.
MAX_NUM_SPECULATIVE_TOKENS = 128


def check_num_speculative_tokens(k: int, field: str, source: str | None = None) -> int:
    """The bound on K, in one place for every reader of it (``--speculative-config``, a
    speculators checkpoint and its override, a TRT-LLM ``max_draft_len``): ``k``, an int >= 1 as
    its reader checked, at most :data:`MAX_NUM_SPECULATIVE_TOKENS`; a
    :class:`~kvslots.ConfigError` naming ``field`` otherwise."""
    if k > MAX_NUM_SPECULATIVE_TOKENS:
        raise ConfigError(f"must be <= {MAX_NUM_SPECULATIVE_TOKENS} (vLLM verifies at most "
                          f"{MAX_NUM_SPECULATIVE_TOKENS} draft tokens per step), got {k}", field, source)
    return k


def resolve_speculative_config(
    base: Mapping[str, Any] | None,
    explicit: Mapping[str, Any] | None = None,
    *,
    from_checkpoint: bool = False,
    explicit_source: str = "--speculative-config",
    notes: list[str] | None = None,
) -> dict[str, Any] | None:
    """The speculative config vLLM gets (``None``: no speculative decoding).

    ``base`` is the config a speculators checkpoint (``from_checkpoint``) or a converted TRT-LLM
    YAML gives, ``explicit`` one the user gave (``explicit_source`` names where). An explicit
    config replaces a YAML's; over a checkpoint's it is merged, as vLLM does, and may not change
    its ``method`` or ``model``. Either way, what is overridden is appended to ``notes``.

    The result is validated: ``num_speculative_tokens`` given, an integer >= 1 (for every method),
    a ``num_speculative_tokens_per_batch_size`` schedule that fits it, ``method`` a non-empty
    string without a NUL or a lone surrogate and a ``model``, when given, a string naming a local
    directory or a Hub id; then every key and value against the installed vLLM's
    ``SpeculativeConfig`` fields (:func:`check_vllm_fields`). Raises
    :class:`~kvslots.ConfigError` naming the key.
    """
    plain: list[dict[str, Any] | None] = []
    for given, what in ((base, "base"), (explicit, explicit_source)):
        if given is not None and not isinstance(given, Mapping):  # dict() of it was a TypeError
            raise ConfigError(f"must be a JSON object, got {type(given).__name__} {short(given)}", what)
        # A file's value rules for a mapping from Python too: a NaN, a set, an integer past 64
        # bits or a cycle was returned as the speculative config (the CLI's JSON is checked). Read
        # once, as plain data: a Mapping's or a key's own methods are not called again below.
        plain.append(None if given is None else check_values(given, what))
    base, explicit = plain
    said = notes if notes is not None else []
    spec = dict(base) if base is not None else None
    if explicit is not None:
        if from_checkpoint and spec is not None:
            for key in CHECKPOINT_LOCKED_KEYS:
                if key in explicit and explicit[key] != spec.get(key):
                    raise ConfigError(
                        f"{key} {explicit[key]!r} conflicts with the speculators checkpoint MODEL "
                        f"({key} {spec.get(key)!r})", source=explicit_source)
            changed = sorted(k for k in explicit if spec.get(k) != explicit[k])
            if changed:
                said.append(f"{explicit_source} overrides the checkpoint's {', '.join(changed)}")
            spec = {**spec, **explicit}
        else:
            if spec is not None:
                said.append(f"{explicit_source} replaces the YAML's speculative_config ({short(spec, 80, plain=True)})")
            spec = dict(explicit)
    if spec is None:
        return None
    method = spec.get("method")
    if method is not None:
        # Text as the other strings are (from Python a NUL or a lone surrogate was returned).
        # Checked against the installed vLLM's methods by check_vllm_fields below (its list
        # changes with its version: one Literal per model's MTP).
        if not isinstance(method, str):
            raise ConfigError(f"must be a string, got {short(method)}", "speculative_config.method")
        spec["method"] = method = str.__str__(method)  # the text itself: a subclass's __contains__ never runs
        problem = "must not be empty" if not method else text_problem(method)
        if problem:
            raise ConfigError(f"{problem}, got {short(method)}", "speculative_config.method")
    # Required for every method: vLLM derives K only for suffix decoding and for drafts whose
    # config.json has n_predict, and kvslots needs K (the lookahead it reserves) before vLLM runs.
    nst = spec.get("num_speculative_tokens")
    if nst is None:
        raise ConfigError("is required (an integer >= 1: the draft tokens per step)",
                          "speculative_config.num_speculative_tokens")
    if isinstance(nst, bool) or not isinstance(nst, int) or nst < 1:
        raise ConfigError(f"must be an integer >= 1, got {short(nst)}", "speculative_config.num_speculative_tokens")
    check_num_speculative_tokens(nst, "speculative_config.num_speculative_tokens")
    DynamicSDSchedule.from_speculative_config(spec)
    draft = spec.get("model")
    if draft is not None and not isinstance(draft, str):
        raise ConfigError(f"must be a local directory or a Hub id (a string), got {short(draft)}",
                          "speculative_config.model")
    if draft is not None:
        spec["model"] = check_draft_model(draft, "speculative_config.model").argument
    check_vllm_fields(spec)
    return spec


#: Where vLLM 0.32 defines the speculative config it builds from ``--speculative-config``.
VLLM_SPECULATIVE_CONFIG = ("vllm.config.speculative", "SpeculativeConfig")


def check_vllm_fields(spec: dict[str, Any], field: str = "speculative_config") -> None:
    """Every key of ``spec`` checked against the installed vLLM's ``SpeculativeConfig`` fields
    and their types (:mod:`kvslots.config.vllm_fields`, which reads vLLM's source: vLLM is not
    imported): a key it has no field for is refused as vLLM refuses it (pydantic's "unexpected
    keyword argument"), a value of the wrong type or out of the field's bounds with pydantic's
    message, either a :class:`~kvslots.ConfigError` naming the key. vLLM built the config, and
    failed on such a key, only once it ran. A value vLLM reads as another of the field's type
    (``"disable_eagle_block_drop": "false"`` is False) is replaced by that one, so that kvslots
    reads it as vLLM does. Without vLLM's source (not installed) nothing is checked here."""
    from .vllm_fields import dataclass_fields, validate_field

    if not isinstance(spec, dict):  # its values are replaced in place
        raise ArgumentTypeError(f"spec must be a dict, got {type(spec).__name__}")
    fields = dataclass_fields(*VLLM_SPECULATIVE_CONFIG)
    if fields is None:
        return
    for key in list(spec):
        if not isinstance(key, str):  # a mapping from Python: no keyword argument is named so
            raise ConfigError(f"keys must be strings (vLLM's SpeculativeConfig keyword arguments), got {short(key)}",
                              field)
        name = key.replace("-", "_")  # as vLLM's create_speculative_config renames them
        rule = fields.get(name)
        if rule is None:
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"unexpected keyword argument: vLLM's SpeculativeConfig has no such field{hint}",
                              f"{field}.{key}")
        value, where, problem = validate_field(rule, spec[key])
        if problem is not None:
            raise ConfigError(f"{problem} (vLLM's SpeculativeConfig.{name} is {rule.annotation}), got "
                              f"{short(spec[key])}", f"{field}.{key}{where}")
        if value is None or type(value) in (bool, int, float, str):
            spec[key] = value


def check_draft_model(draft: str, field: str, source: str | None = None, what: str = "draft model") -> ModelRef:
    """A draft (or, with ``what``, another) model reference, ``field`` naming where it was given:
    a local directory or a Hub id, which vLLM looks up itself. A path that certainly names no
    directory (``"missing"``, ``"not_dir"``) is a :class:`~kvslots.ConfigError`. What vLLM is to
    get is the result's :attr:`ModelRef.argument`. A local directory's config.json, if it has one,
    must be one kvslots' reader accepts."""
    ref = classify_model(draft)
    if ref.kind == "missing":
        raise ConfigError(f"{what} directory {draft!r} does not exist", field, source)
    if ref.kind == "not_dir":
        raise ConfigError(f"{what} {draft!r} is not a directory", field, source)
    if ref.is_local and ref.config is None and os.path.lexists(os.path.join(ref.path, "config.json")):
        # vLLM reads it when the engine starts: one kvslots cannot read (not JSON, an array,
        # NaN, a key twice, a FIFO) failed there, after start-up. (A directory without one may
        # still be filled before the engine starts: convert-config's output is used elsewhere.)
        try:
            read_model_config(ref.path, what)
        except ConfigError as e:
            raise ConfigError(f"{what}: {e}", field, source) from e
    return ref


__all__ = [
    "CHECKPOINT_LOCKED_KEYS",
    "HUB_ID",
    "MAX_NUM_SPECULATIVE_TOKENS",
    "SPECULATORS_METHODS",
    "ModelRef",
    "check_draft_model",
    "check_num_speculative_tokens",
    "check_vllm_fields",
    "classify_model",
    "is_hub_id",
    "is_speculators_checkpoint",
    "read_model_config",
    "reference_text",
    "resolve_speculative_config",
]
