"""Captures real KV event batches from a tiny vLLM run on CPU, as a test fixture.

    python scripts/capture_vllm_kv_events.py tests/data/vllm_kv_events.msgpack

Needs vLLM (the project's vLLM venv: scripts/install-vllm.sh). Nothing is downloaded: the model
is a 2-layer Llama with random weights written locally, prompts are token ids (no tokenizer).
Prompts share prefixes (prefix-cache hits) and the KV cache is kept small (evictions), so the
stream has BlockStored, re-reported cached blocks and BlockRemoved. The events are taken from
vLLM's own ZMQ publisher through its replay endpoint (every batch from seq 0), exactly as the
indexer receives them.

The fixture (msgpack map): vllm_version, block_size, prompts (token id lists), frames
([seq, topic, payload] as published).
"""

from __future__ import annotations

import os
import random
import socket
import sys
import tempfile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32",
                      architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)


def replay_all(endpoint: str, timeout_ms: int = 10_000) -> list[list]:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    frames = []
    while sock.poll(timeout_ms):
        msg = sock.recv_multipart()
        _, topic, seq_b, payload = msg
        seq = int.from_bytes(seq_b, "big", signed=True)
        if seq == -1:
            break
        frames.append([seq, topic, payload])
    sock.close(linger=0)
    ctx.term()
    return frames


def main(out: str) -> int:
    import msgspec
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    block_size = 32  # vLLM's CPU backend wants a multiple of 32
    rng = random.Random(0)
    system_a = [rng.randrange(3, 1024) for _ in range(96)]
    system_b = [rng.randrange(3, 1024) for _ in range(64)]
    prompts = []
    for i in range(10):
        base = system_a if i % 3 else system_b
        prompts.append(base + [rng.randrange(3, 1024) for _ in range(rng.randint(10, 80))])
    pub, rep = free_port(), free_port()
    with tempfile.TemporaryDirectory() as d:
        build_model(d)
        llm = LLM(
            model=d, skip_tokenizer_init=True, dtype="float32", block_size=block_size, max_model_len=512,
            enable_prefix_caching=True, num_gpu_blocks_override=24, max_num_seqs=4, enforce_eager=True,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                            endpoint=f"tcp://*:{pub}", replay_endpoint=f"tcp://*:{rep}",
                                            topic="kv"),
        )
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, detokenize=False)
        # Two waves: the second re-sends prompts so cached prefixes are hit (and re-reported).
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[::2]], params)
        frames = replay_all(f"tcp://127.0.0.1:{rep}")
        del llm
    doc = {"vllm_version": vllm.__version__, "block_size": block_size, "prompts": prompts, "frames": frames}
    with open(out, "wb") as f:
        f.write(msgspec.msgpack.encode(doc))
    kinds: dict[str, int] = {}
    for _, _, payload in frames:
        for ev in msgspec.msgpack.decode(payload)[1]:
            kinds[ev["type"]] = kinds.get(ev["type"], 0) + 1
    print(f"wrote {out}: {len(frames)} batches, events {kinds}, {os.path.getsize(out)} bytes")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "tests/data/vllm_kv_events.msgpack"))
