"""Tiny random-weight Llama target + EAGLE / EAGLE-3 heads for vLLM 0.32 on CPU, built locally.

Nothing is downloaded: the tokenizer is a `tokenizers` WordLevel model built in-process and
wrapped in PreTrainedTokenizerFast. Used by the tests and the demo.

    python -m kvslots._dev.tiny DIR      # -> DIR/{target,eagle,eagle3}
    python -m kvslots._dev.tiny DIR --layers 8 --hidden 1024 --heads 16 --kv-heads 4
                                         # the "realistic" model of benches/bench_served.py

The default dimensions are the tiny ones (2 layers, hidden 128); :class:`Dims` sets others (the
EAGLE heads follow the target's hidden size and heads). Weights are random either way.

Checkpoint formats (vLLM 0.32):
  * target: plain LlamaForCausalLM (save_pretrained).  head_dim must be one of
    the CPU attention sizes [32, 64, 80, ...] -> hidden 128 / 4 heads = 32.
  * eagle (EAGLE-1, model_executor/models/llama_eagle.py): config.json of a
    LlamaConfig with architectures ["LlamaForCausalLM"] (vLLM wraps it in
    EAGLEConfig and renames the arch to EagleLlamaForCausalLM), 1 layer; weights
    WITHOUT "model." prefix: fc.weight [H, 2H], layers.0.self_attn.{q,k,v,o}_proj,
    layers.0.mlp.{gate,up,down}_proj, layers.0.post_attention_layernorm
    (layer 0 has no input_layernorm).  embed_tokens / lm_head optional (shared
    from the target when absent).  Hidden size must equal the target's.
  * eagle3 (llama_eagle3.py): LlamaConfig, 1 layer, arch -> Eagle3LlamaForCausalLM;
    weights: midlayer.* (mapped to layers.0.*) with q/k/v_proj input 2H,
    midlayer.hidden_norm, midlayer.input_layernorm, midlayer.post_attention_layernorm,
    norm.weight, fc.weight [H, n_aux*H_target], lm_head.weight [draft_vocab, H];
    d2t (int64 [draft_vocab]) only if draft_vocab_size != vocab_size;
    embed_tokens optional.  eagle_aux_hidden_state_layer_ids must be valid for a
    2-layer target (the default (2, L//2, L-3) is nonsense for L=2), so we set
    [0, 1, 2] (0 = embeddings, i = output of layer i-1... see llama.py:427-441).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch
from safetensors.torch import save_file

from ..cli import write_file
from ..config.loader import brief, read_config_text
from ..errors import ConfigError

VOCAB = 2048
HIDDEN = 128
INTER = 256
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 32 (CPU attn min head size)
LAYERS = 2
MAX_POS = 4096


@dataclass(frozen=True)
class Dims:
    """A model's dimensions. head_dim = hidden // heads must be a CPU attention size (32, 64, ...)."""

    layers: int = LAYERS
    hidden: int = HIDDEN
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    intermediate: int = INTER

    def __post_init__(self) -> None:
        # Each is a divisor or a size below: 0 was a ZeroDivisionError while building.
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 16:
                raise ConfigError(f"must be an integer in [1, 65536], got {value!r}", f"Dims.{name}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ConfigError(f"hidden {self.hidden} must be a multiple of heads {self.heads}, and heads of "
                              f"kv_heads {self.kv_heads}", "Dims")
        # Each size alone is bounded, not their product: --layers 65536 (or hidden and intermediate
        # 65536) asked torch for tens of GB of float32 weights (MemoryError, or the OOM killer).
        if self.num_params > MAX_PARAMS:
            raise ConfigError(f"{self.num_params} target parameters (about {self.num_params * 4 >> 20} MiB of "
                              f"float32 weights), more than {MAX_PARAMS}: not a tiny model", "Dims")

    @property
    def num_params(self) -> int:
        """The target's parameters, about: embeddings and LM head, and per layer the attention
        and MLP projections."""
        kv = self.kv_heads * (self.hidden // self.heads)
        return 2 * VOCAB * self.hidden + self.layers * (
            2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.intermediate)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


#: Most target parameters Dims allows (1 GiB of float32 weights; the "realistic" model has ~80M).
MAX_PARAMS = 1 << 28

TINY = Dims()
#: The benchmarks' "realistic" model: compute per KV byte closer to real serving (fp32, ~40M
#: parameters without embeddings; MLP twice the hidden size, as the tiny one).
REALISTIC = Dims(layers=8, hidden=1024, heads=16, kv_heads=4, intermediate=2048)

WORDS = (
    "the quick brown fox jumps over lazy dog hello world kv cache slot manager "
    "speculative decoding draft token accept reject block hash prefix vllm rust "
    "python test one two three four five six seven eight nine ten"
).split()


def _llama_config(num_layers: int, dims: Dims = TINY, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=dims.hidden,
        intermediate_size=dims.intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads,
        head_dim=dims.head_dim,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        dtype="float32",  # transformers 5 name; torch_dtype was its alias (same config.json)
        architectures=["LlamaForCausalLM"],
        **extra,
    )


def build_tokenizer(out_dir: str) -> None:
    """WordLevel tokenizer whose vocab is exactly VOCAB ids (so every id the
    random model can emit detokenizes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    i = 0
    while len(vocab) < VOCAB:
        vocab.setdefault(f"t{i}", len(vocab))
        i += 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
        model_max_length=MAX_POS,
    )
    fast.save_pretrained(out_dir)


def _rand(*shape, std=0.02):
    return torch.randn(*shape) * std


def build_target(out_dir: str, seed: int = 0, dims: Dims = TINY) -> str:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    os.makedirs(out_dir, exist_ok=True)
    cfg = _llama_config(dims.layers, dims)
    # transformers types its @wraps(nn.Module.to) method as unbound (self taken as the dtype).
    model = LlamaForCausalLM(cfg).to(torch.float32)  # type: ignore[arg-type]
    # Larger init so greedy outputs are not all the same token (scaled so that wider models
    # keep the tiny one's activation scale: std 0.2 at fan-in 128).
    std = 0.2 * (HIDDEN / dims.hidden) ** 0.5
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir)
    return out_dir


def _write(out_dir: str, cfg, tensors: dict[str, torch.Tensor], target_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    cfg.save_pretrained(out_dir)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    # A tokenizer next to the head is harmless and keeps tools that open the
    # draft dir as a model happy; vLLM uses the target's tokenizer.
    build_tokenizer(out_dir)


def _layer(prefix: str, qkv_in: int, dims: Dims = TINY) -> dict[str, torch.Tensor]:
    h, hd, inter = dims.hidden, dims.head_dim, dims.intermediate
    return {
        f"{prefix}.self_attn.q_proj.weight": _rand(dims.heads * hd, qkv_in),
        f"{prefix}.self_attn.k_proj.weight": _rand(dims.kv_heads * hd, qkv_in),
        f"{prefix}.self_attn.v_proj.weight": _rand(dims.kv_heads * hd, qkv_in),
        f"{prefix}.self_attn.o_proj.weight": _rand(h, dims.heads * hd),
        f"{prefix}.mlp.gate_proj.weight": _rand(inter, h),
        f"{prefix}.mlp.up_proj.weight": _rand(inter, h),
        f"{prefix}.mlp.down_proj.weight": _rand(h, inter),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(h),
    }


def build_eagle(out_dir: str, target_dir: str, seed: int = 1, dims: Dims = TINY) -> str:
    """EAGLE-1 head (EagleLlamaForCausalLM).  Shares embed_tokens and lm_head
    with the target (not stored)."""
    torch.manual_seed(seed)
    cfg = _llama_config(1, dims)
    t = _layer("layers.0", dims.hidden, dims)  # no input_layernorm on layer 0
    t["fc.weight"] = _rand(dims.hidden, 2 * dims.hidden)
    _write(out_dir, cfg, t, target_dir)
    return out_dir


def build_eagle3(out_dir: str, target_dir: str, seed: int = 2,
                 aux_layer_ids=(0, 1, 2), dims: Dims = TINY) -> str:
    """EAGLE-3 head (Eagle3LlamaForCausalLM), same vocab as target (no d2t)."""
    torch.manual_seed(seed)
    n_aux = len(aux_layer_ids)
    HIDDEN = dims.hidden  # noqa: N806 (the head's hidden size is the target's)
    cfg = _llama_config(
        1,
        dims,
        draft_vocab_size=VOCAB,
        target_hidden_size=HIDDEN,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
        eagle_config={
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
            "use_aux_hidden_state": True,
        },
    )
    t = _layer("midlayer", 2 * HIDDEN, dims)
    t["midlayer.input_layernorm.weight"] = torch.ones(HIDDEN)
    t["midlayer.hidden_norm.weight"] = torch.ones(HIDDEN)
    t["norm.weight"] = torch.ones(HIDDEN)
    t["fc.weight"] = _rand(HIDDEN, n_aux * HIDDEN)
    t["lm_head.weight"] = _rand(VOCAB, HIDDEN)
    _write(out_dir, cfg, t, target_dir)
    return out_dir


def build_tiny_models(root: str, dims: Dims = TINY) -> dict[str, str]:
    """Builds (once: a finished build of the same dimensions is reused) the target, EAGLE and
    EAGLE-3 dirs under root."""
    root = os.fspath(root) if isinstance(root, os.PathLike) else root
    if not isinstance(root, str):
        raise ConfigError(f"the models' directory must be a path (str), got {type(root).__name__}")
    if not root:  # os.path.join("", "target") is ./target: the models were written into the working directory
        raise ConfigError("the models' directory: an empty path names no directory")
    if not isinstance(dims, Dims):  # dataclasses.asdict's TypeError, or its fields read as attributes
        raise ConfigError(f"must be a Dims, got {type(dims).__name__}", "dims")
    paths = {name: os.path.join(root, name) for name in ("target", "eagle", "eagle3")}
    done = os.path.join(root, ".complete")
    stamp = json.dumps(asdict(dims), sort_keys=True)
    # A ConfigError naming root, not a traceback, for a root that is a file, unwritable, full,
    # or holds something else (kvslots demo --cache-dir).
    try:
        if os.path.lexists(done):
            text = read_config_text(done, max_bytes=4096).strip()
            # "ok" marks a build of the tiny dimensions made before Dims existed.
            if text == stamp or (text == "ok" and dims == TINY):
                return paths
            raise ConfigError(f"holds models of other dimensions ({brief(text)}), not {stamp}", None, root)
        build_target(paths["target"], dims=dims)
        build_eagle(paths["eagle"], paths["target"], dims=dims)
        # The EAGLE-3 head reads three auxiliary hidden states: embeddings, layer L//2, last layer.
        aux = (0, 1, 2) if dims.layers <= 2 else (0, dims.layers // 2, dims.layers)
        build_eagle3(paths["eagle3"], paths["target"], aux_layer_ids=aux, dims=dims)
        # Whole or not at all: a marker cut short (a full disk) named "models of other
        # dimensions" on every later run, until removed by hand.
        write_file(done, stamp + "\n")
    except ConfigError:
        raise
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise ConfigError(f"cannot build the tiny models: {getattr(e, 'strerror', None) or e}", None, root) from None
    return paths


def main(argv: list[str] | None = None) -> int:
    """``python -m kvslots._dev.tiny [ROOT]``: errors are one line and exit status 2, as in the
    ``kvslots`` commands."""
    from ..cli import OneLineParser, handle_ending_signals, run_command

    if argv is None:  # the program itself: a SIGTERM as the marker is written leaves no temporary file
        handle_ending_signals()
    ap = OneLineParser(prog="python -m kvslots._dev.tiny",
                       description="Build tiny random-weight models (target, EAGLE, EAGLE-3).")
    ap.add_argument("root", nargs="?", default="/tmp/kvslots-tiny")
    ap.add_argument("--layers", type=int, default=TINY.layers)
    ap.add_argument("--hidden", type=int, default=TINY.hidden)
    ap.add_argument("--heads", type=int, default=TINY.heads)
    ap.add_argument("--kv-heads", type=int, default=TINY.kv_heads)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP size (default: 2 x hidden)")
    a = ap.parse_args(argv)

    def build(a: argparse.Namespace) -> None:
        # "is None", not "or": --intermediate 0 was taken as the default, not refused by Dims.
        dims = Dims(a.layers, a.hidden, a.heads, a.kv_heads, 2 * a.hidden if a.intermediate is None else a.intermediate)
        print(json.dumps(build_tiny_models(a.root, dims), indent=1))

    return run_command(build, a, ap.prog)


if __name__ == "__main__":
    sys.exit(main())
