"""``speculative_config``: TRT-LLM's decoding types -> vLLM's speculative methods, the draft model
and K, the dynamic draft length (``max_concurrency`` / ``draft_len_schedule`` -> a
``num_speculative_tokens_per_batch_size`` schedule), and a speculators checkpoint replacing it.

What a draft model reference names (and what its config.json says about EAGLE) is decided by
:mod:`kvslots.config.speculative`; this module holds only the TRT-LLM side.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ..schedule import SCHEDULE_KEY, DynamicSDSchedule
from ..speculative import check_draft_model, check_num_speculative_tokens, classify_model
from ..speculators import load_speculators_checkpoint
from .base import ConverterBase, describe
from .keys import (
    DECODING_BY_LOWER,
    DECODING_TYPES,
    SPEC_COMMON_IGNORED,
    SPEC_TYPE_IGNORED,
    TRTLLM_DEFAULT_MAX_BATCH_SIZE,
)
from .result import MappedKey


class SpeculativeKeys(ConverterBase):
    """``speculative_config``, converted once every other key is read (:meth:`post_speculative`:
    the schedule needs the batch size limit)."""

    def k_speculative_config(self, v: Any, p: str) -> None:
        self.spec_given = True
        self.spec_doc = v

    def post_speculative(self) -> None:
        if not self.spec_given or self.spec_doc is None:
            if self.spec_given:
                self.ignore("speculative_config", None, "null: no speculative decoding")
            return
        p = "speculative_config"
        spec = self.mapping(self.spec_doc, p, allow_none=False)
        if "decoding_type" not in spec:
            raise self.fail(f"{p}.decoding_type", "is required (Eagle, Eagle3, MTP, NGram, Draft_Target, ...)")
        raw_type = spec["decoding_type"]
        if not isinstance(raw_type, str):
            raise self.fail(f"{p}.decoding_type", f"must be a string, got {describe(raw_type)}")
        dtype = DECODING_BY_LOWER.get(raw_type.lower())
        if dtype is None:
            raise self.fail(f"{p}.decoding_type",
                            f"unknown decoding type {raw_type!r}; expected one of {', '.join(DECODING_TYPES)}")
        if dtype in ("User_Provided", "SaveState"):
            raise self.fail(f"{p}.decoding_type",
                            f"{dtype} has no vLLM equivalent (it needs a Python drafter object / only saves hidden states)")
        handled = {"decoding_type", "max_draft_len", "speculative_model", "speculative_model_dir",
                   "pytorch_weights_path", "max_concurrency", "draft_len_schedule"}
        out: dict[str, Any] = {}

        # Draft model (three spellings across TRT-LLM versions).
        model_keys = [k for k in ("speculative_model", "speculative_model_dir", "pytorch_weights_path") if spec.get(k) is not None]
        if len(model_keys) > 1 and len({str(spec[k]) for k in model_keys}) > 1:
            raise self.fail(f"{p}.{model_keys[1]}", f"conflicts with {p}.{model_keys[0]}")
        model_path = f"{p}.{model_keys[0]}" if model_keys else f"{p}.speculative_model_dir"
        model = self.str_(spec[model_keys[0]], model_path) if model_keys else None
        if model is not None:  # ~ expanded as vLLM is to get it (checked once the checkpoint is known)
            model = classify_model(model).argument
        for extra in model_keys[1:]:
            self.ignore(f"{p}.{extra}", spec[extra], f"same draft model as {model_path}")

        # Draft length.
        k: int | None = None
        if spec.get("max_draft_len") is not None:
            k = self.int_(spec["max_draft_len"], f"{p}.max_draft_len", 0)

        if dtype in ("Eagle", "Eagle3"):
            handled.add("eagle3_one_model")
            if model is None:
                raise self.fail(f"{p}.speculative_model_dir", f"a draft model is required for {dtype}")
            one_model = spec.get("eagle3_one_model")
            if one_model is not None:
                self.bool_(one_model, f"{p}.eagle3_one_model")
            method, why = _eagle_method(dtype, model, one_model)
            k = self._need_k(k, dtype)
            out.update(method=method, model=model, num_speculative_tokens=k)
            self.note(f"{p}.decoding_type", "speculative_config.method", method)
            if one_model is not None:
                self.note(f"{p}.eagle3_one_model", "speculative_config.method", method)
            self.warnings.extend(f"{p}: {w}" for w in why)
        elif dtype == "MTP":
            handled.add("num_nextn_predict_layers")
            layers = spec.get("num_nextn_predict_layers")
            if layers is not None:
                layers = self.int_(layers, f"{p}.num_nextn_predict_layers", 1)
            if k is not None:
                k = self._need_k(k, dtype)
                if layers is not None and layers != k:
                    self.warnings.append(f"{p}: max_draft_len={k} wins over the deprecated num_nextn_predict_layers={layers}")
                    self.ignore(f"{p}.num_nextn_predict_layers", layers, "max_draft_len takes precedence (as in TRT-LLM)")
                    layers = None
            elif layers is not None:
                k = layers
            else:
                k = 1
                self.warnings.append(f"{p}: no max_draft_len or num_nextn_predict_layers; TRT-LLM reads the "
                                     "checkpoint's MTP layer count, vLLM needs num_speculative_tokens: using 1")
            out["method"] = "mtp"
            if model is not None:
                out["model"] = model
            out["num_speculative_tokens"] = k
            if layers is not None:
                self.note(f"{p}.num_nextn_predict_layers", "speculative_config.num_speculative_tokens", k)
            self.note(f"{p}.decoding_type", "speculative_config.method", "mtp")
        elif dtype in ("NGram", "AUTO"):
            handled.add("max_matching_ngram_size")
            k = self._need_k(k, dtype)
            n = spec.get("max_matching_ngram_size", 2)
            n = self.int_(n, f"{p}.max_matching_ngram_size", 1)
            out.update(method="ngram", num_speculative_tokens=k, prompt_lookup_max=n, prompt_lookup_min=1)
            if "max_matching_ngram_size" in spec:
                self.note(f"{p}.max_matching_ngram_size", "speculative_config.prompt_lookup_max", n)
            self.note(f"{p}.decoding_type", "speculative_config.method", "ngram")
            if dtype == "AUTO":
                self.warnings.append(f"{p}: decoding_type AUTO (TRT-LLM's heuristic draft-free method) became n-gram lookup")
            if model is not None:
                self.ignore(model_path, model, "n-gram lookup needs no draft model")
        elif dtype == "SA":
            k = self._need_k(k, dtype)
            out.update(method="suffix", num_speculative_tokens=k)
            self.note(f"{p}.decoding_type", "speculative_config.method", "suffix")
            self.warnings.append(f"{p}: suffix-automaton drafting became vLLM's suffix decoding (a suffix tree, "
                                 "which needs the arctic-inference package)")
        elif dtype in ("Draft_Target", "PARD", "DFlash"):
            if model is None:
                raise self.fail(f"{p}.speculative_model_dir", f"a draft model is required for {dtype}")
            k = self._need_k(k, dtype)
            method = {"Draft_Target": "draft_model", "PARD": "draft_model", "DFlash": "dflash"}[dtype]
            out.update(method=method, model=model, num_speculative_tokens=k)
            if dtype == "PARD":
                out["parallel_drafting"] = True
            self.note(f"{p}.decoding_type", "speculative_config.method", method)
        elif dtype == "DSpark":
            k = self._need_k(k, dtype)
            out["method"] = "dspark"
            if model is not None:
                out["model"] = model
            out["num_speculative_tokens"] = k
            self.note(f"{p}.decoding_type", "speculative_config.method", "dspark")
        if "max_draft_len" in spec:
            self.note(f"{p}.max_draft_len", "speculative_config.num_speculative_tokens", out["num_speculative_tokens"])
        if "model" in out:
            self.note(model_path, "speculative_config.model", out["model"])
            self.draft_path = model_path

        # K from max_draft_len, or from the deprecated num_nextn_predict_layers (MTP).
        k = check_num_speculative_tokens(
            out["num_speculative_tokens"],
            f"{p}.max_draft_len" if spec.get("max_draft_len") is not None else f"{p}.num_nextn_predict_layers",
            self.source)

        # Dynamic draft length.
        mc, dls = spec.get("max_concurrency"), spec.get("draft_len_schedule")
        max_bs = self.args.get("max_num_seqs", TRTLLM_DEFAULT_MAX_BATCH_SIZE)
        if mc is not None and dls is not None:
            raise self.fail(f"{p}.draft_len_schedule", "max_concurrency and draft_len_schedule are mutually exclusive")
        if mc is not None:
            mc = self.int_(mc, f"{p}.max_concurrency", 1)
            try:
                self.schedule = DynamicSDSchedule.from_max_concurrency(mc, k, max_batch_size=max_bs)
            except ConfigError as e:
                raise ConfigError(e.reason, e.field, self.source) from None
            self.note(f"{p}.max_concurrency", f"speculative_config.{SCHEDULE_KEY}", self.schedule.to_list())
        elif dls is not None:
            try:
                self.schedule = DynamicSDSchedule.from_draft_len_schedule(
                    dls, k, max_batch_size=max_bs, field=f"{p}.draft_len_schedule")
            except ConfigError as e:
                raise ConfigError(e.reason, e.field, self.source) from None
            self.note(f"{p}.draft_len_schedule", f"speculative_config.{SCHEDULE_KEY}", self.schedule.to_list())
        if self.schedule is not None:
            out[SCHEDULE_KEY] = self.schedule.to_list()
            if self.args.get("data_parallel_size", 1) > 1:
                self.warnings.append(f"{p}: vLLM 0.32 disables num_speculative_tokens_per_batch_size with data "
                                     "parallelism and speculates with the fixed maximum K")

        ignored_here = dict(SPEC_COMMON_IGNORED)
        ignored_here.update(SPEC_TYPE_IGNORED.get(dtype, {}))
        for key, value in spec.items():
            if key in handled:
                continue
            sub = f"{p}.{key}"
            if key in ignored_here:
                self.ignore(sub, value, ignored_here[key])
            else:
                self.unknown(sub, value, f"speculative_config option for {dtype}")
        self.args["speculative_config"] = out

    def check_draft_model(self) -> None:
        """The converted draft model names a directory or a Hub id (kvslots.config.speculative's
        rule); run unless a speculators checkpoint replaced it."""
        spec = self.args.get("speculative_config") or {}
        if self.draft_path is not None and "model" in spec:
            check_draft_model(spec["model"], self.draft_path, self.source)

    def _need_k(self, k: int | None, dtype: str) -> int:
        if k is None:
            raise self.fail("speculative_config.max_draft_len", f"is required for {dtype}")
        if k == 0:
            raise self.fail("speculative_config.max_draft_len", f"must be > 0 for {dtype}, got 0")
        return k

    def apply_speculators_checkpoint(self, speculators_dir: str | os.PathLike[str], verifier: str | None,
                                     model: str | None) -> None:
        """A speculators checkpoint replaces the converted speculative config (method and K from the
        checkpoint, the YAML's dynamic schedule kept if it fits); its verifier becomes the model
        unless ``model`` is given."""
        ckpt = load_speculators_checkpoint(speculators_dir, verifier=verifier)
        spec = dict(ckpt.speculative_config)
        old = self.args.get("speculative_config")
        if old is not None:
            self.warnings.append(
                f"--speculators-dir replaces speculative_config (method {old.get('method')}, K="
                f"{old.get('num_speculative_tokens')}) with the checkpoint's (method {spec['method']}, "
                f"K={spec['num_speculative_tokens']})"
            )
        if self.schedule is not None:
            try:
                sched = DynamicSDSchedule.parse(self.schedule.to_list(), spec["num_speculative_tokens"])
            except ConfigError as e:
                raise ConfigError(
                    f"the YAML's dynamic draft-length schedule does not fit the checkpoint's K="
                    f"{spec['num_speculative_tokens']}: {e.reason}", e.field, self.source
                ) from None
            spec[SCHEDULE_KEY] = sched.to_list()
            self.schedule = sched
        self.args["speculative_config"] = spec
        self.mapped.append(MappedKey(f"{ckpt.path}/config.json", "speculative_config", spec))
        self.warnings.extend(f"speculators checkpoint: {w}" for w in ckpt.warnings)
        if model is None:
            if self.args.get("model") not in (None, ckpt.verifier):
                self.warnings.append(f"the YAML's model {self.args['model']!r} replaced by the checkpoint's verifier {ckpt.verifier!r}")
            self.args["model"] = ckpt.verifier
            self.mapped.append(MappedKey(f"{ckpt.path}/config.json:speculators_config.verifier.name_or_path",
                                         "model", ckpt.verifier))


def _eagle_method(dtype: str, model: str, one_model: bool | None) -> tuple[str, list[str]]:
    """eagle or eagle3 for a TRT-LLM Eagle config, and notes on how it was decided.

    Evidence, strongest first: the draft checkpoint's config.json (when the path is local),
    "eagle3" in the draft's name, ``decoding_type: Eagle3`` or ``eagle3_one_model: true`` (the
    one-model path exists only for EAGLE-3), "eagle" in the draft's name or
    ``eagle3_one_model: false``, and last TRT-LLM's default (EAGLE-3 on the PyTorch backend).
    """
    ckpt = classify_model(model).draft_method
    if ckpt is not None:
        method, why = ckpt
        if method != "eagle3" and (dtype == "Eagle3" or one_model is True):
            return method, [f"the draft checkpoint is {method} ({why}) although the YAML says EAGLE-3; using {method}"]
        return method, []
    lower = Path(model.rstrip("/")).name.lower()  # the name, not the directories above it
    if re.search(r"eagle-?3", lower):
        return "eagle3", []
    if dtype == "Eagle3" or one_model is True:
        return "eagle3", []
    if "eagle" in lower:
        return "eagle", [f"method eagle chosen from the draft model's name {model!r}"]
    if one_model is False:
        return "eagle", [
            "eagle3_one_model=false and nothing says the draft is EAGLE-3: using method eagle "
            "(TRT-LLM's two-model path also ran EAGLE-3; use decoding_type: Eagle3 for an EAGLE-3 draft)"
        ]
    return "eagle3", [
        "nothing says whether the draft is EAGLE or EAGLE-3: using eagle3 (TRT-LLM's PyTorch backend runs "
        "EAGLE-3 by default)"
    ]



__all__ = ["SpeculativeKeys"]
