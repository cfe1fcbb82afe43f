"""The speculative-decoding workload every benchmark replays, generated once from a seed.

The trace is a pure function of ``TraceConfig``: a counter-based random generator (splitmix64's
mixer over ``key + (i + 1) * GAMMA``) keyed by (seed, request, purpose), so that
``rust/core/benches/engine.rs`` regenerates exactly the same trace in Rust (same requests, same
tokens, same schedule; both print the same digest). Keep the two in step.

Workload (per request ``r``):
- prompt: 512-2048 tokens; 30% of requests share one 1024-token prefix (their length is then
  1025-2048: the shared prefix plus at least one token of their own);
- output: 128-512 tokens; every decode step proposes ``K`` drafts, each accepted with
  probability 0.7 until the first rejection, so a step yields ``1 + a`` tokens (``a`` accepted
  drafts plus the bonus token);
- steady batch: ``B`` requests run; a finished request is replaced by the next one at once.

Step ``s`` of the trace, in the order an engine does it (and vLLM's scheduler does it):
1. ``finishes``: requests whose last step's output reached their output length end (no commit
   of that last output: vLLM does not cache it either);
2. ``batch``: every other running request, with the result of step ``s - 1`` (``num_accepted``
   tokens to commit and ``num_rejected`` drafts to roll back; 0/0 right after the prefill) and
   ``1 + K`` new positions plus ``K`` lookahead to reserve;
3. ``admits``: new requests fill the batch up to ``B``: prefix-cache match, prefill (reserve the
   rest of the prompt plus ``K``), commit the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MASK = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB

# Purposes of the per-request random streams.
META, PROMPT, OUTPUT, ACCEPT = 0, 1, 2, 3
SHARED_STREAM = 1 << 32  # the request number of the shared prefix's stream


def mix64(z: int) -> int:
    z &= MASK
    z = ((z ^ (z >> 30)) * _M1) & MASK
    z = ((z ^ (z >> 27)) * _M2) & MASK
    return z ^ (z >> 31)


def key(seed: int, stream: int, purpose: int) -> int:
    return mix64((mix64((seed + (stream + 1) * GAMMA) & MASK) + (purpose + 1) * GAMMA) & MASK)


def draws(k: int, n: int, start: int = 0) -> np.ndarray:
    """``n`` 64-bit draws of stream ``k``: ``mix64(k + (i + 1) * GAMMA)`` for i in start..start+n."""
    with np.errstate(over="ignore"):
        z = np.arange(start + 1, start + n + 1, dtype=np.uint64) * np.uint64(GAMMA) + np.uint64(k)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
        return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class TraceConfig:
    batch: int = 256
    k: int = 3
    steps: int = 512
    seed: int = 0
    block_size: int = 16
    acceptance_ppm: int = 700_000
    prompt_min: int = 512
    prompt_max: int = 2048
    shared_prefix: int = 1024
    shared_permille: int = 300
    output_min: int = 128
    output_max: int = 512
    vocab: int = 32000


@dataclass
class Request:
    index: int
    rid: str
    prompt: np.ndarray  # uint32
    output: np.ndarray  # uint32: the tokens the request generates, in order (with slack of K)
    output_len: int
    accepted: list[int]  # accepted drafts per decode step, up to the step that finishes it
    shares: bool


def make_request(cfg: TraceConfig, r: int, shared: np.ndarray) -> Request:
    u0, u1, u2 = (int(x) for x in draws(key(cfg.seed, r, META), 3))
    shares = u1 % 1000 < cfg.shared_permille
    if shares:
        n = cfg.shared_prefix + 1 + u0 % (cfg.prompt_max - cfg.shared_prefix)
        own = draws(key(cfg.seed, r, PROMPT), n - cfg.shared_prefix) % np.uint64(cfg.vocab)
        prompt = np.concatenate([shared, own.astype(np.uint32)])
    else:
        n = cfg.prompt_min + u0 % (cfg.prompt_max - cfg.prompt_min + 1)
        prompt = (draws(key(cfg.seed, r, PROMPT), n) % np.uint64(cfg.vocab)).astype(np.uint32)
    out_len = cfg.output_min + u2 % (cfg.output_max - cfg.output_min + 1)
    output = (draws(key(cfg.seed, r, OUTPUT), out_len + cfg.k) % np.uint64(cfg.vocab)).astype(np.uint32)
    # Decode step t draws K uniforms; a_t = leading accepts. Generated: 1 after the prefill,
    # then + 1 + a_t per decode step; the request ends once it reaches out_len.
    d = (draws(key(cfg.seed, r, ACCEPT), out_len * cfg.k) % np.uint64(1_000_000)).reshape(out_len, cfg.k)
    ok = d < np.uint64(cfg.acceptance_ppm)
    a = np.where(ok.all(axis=1), cfg.k, ok.argmin(axis=1))
    gen = 1 + np.cumsum(1 + a)
    steps = int(np.searchsorted(gen, out_len)) + 1  # first t with gen[t] >= out_len, plus one
    return Request(r, f"req-{r}", prompt, output, out_len, [int(x) for x in a[:steps]], shares)


@dataclass
class Step:
    finishes: list[int]
    batch: np.ndarray  # request indices, int64
    num_accepted: np.ndarray  # uint32
    num_rejected: np.ndarray  # uint32
    accepted_tokens: np.ndarray  # uint32, concatenated in batch order
    admits: list[int]
    # Per batch entry: the tokens the step's output appends to a vLLM Request (the result of
    # step s - 1: the accepted drafts plus the bonus token; the first sampled token after the
    # prefill), as Python lists (what vLLM's scheduler gets from the sampler).
    appended: list[list[int]] = field(default_factory=list)
    # Per batch entry: whether step s - 1 was its prefill (no drafts were scheduled).
    after_prefill: np.ndarray | None = None


@dataclass
class Trace:
    cfg: TraceConfig
    requests: list[Request]
    steps: list[Step]
    request_steps: int
    digest: int
    # Pool sizes (kvslots blocks; vLLM gets one more for its null block).
    roomy_blocks: int
    tight_blocks: int
    peak_blocks: int


def request_steps_from(trace: Trace, start: int) -> int:
    """Request-steps of steps ``start..`` (what a replay timed from step ``start`` does)."""
    return sum(s.batch.size + len(s.admits) for s in trace.steps[start:])


def blocks_for(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


def generate(cfg: TraceConfig) -> Trace:
    shared = (draws(key(cfg.seed, SHARED_STREAM, PROMPT), cfg.shared_prefix) % np.uint64(cfg.vocab)).astype(np.uint32)
    k, bs = cfg.k, cfg.block_size
    requests: list[Request] = []
    running: list[int] = []
    t_of: dict[int, int] = {}  # decode steps done
    gen_of: dict[int, int] = {}  # output tokens generated (sampled)
    com_of: dict[int, int] = {}  # output tokens committed
    blocks_of: dict[int, int] = {}  # blocks held (no sharing), for pool sizing
    steps: list[Step] = []
    request_steps = 0
    digest = 0
    total_blocks = 0
    peak = 0
    for s in range(cfg.steps):
        finishes: list[int] = []
        keep: list[int] = []
        for r in running:
            req = requests[r]
            if gen_of[r] >= req.output_len:
                finishes.append(r)
            else:
                keep.append(r)
        running = keep
        n = len(running)
        acc = np.zeros(n, dtype=np.uint32)
        rej = np.zeros(n, dtype=np.uint32)
        after_prefill = np.zeros(n, dtype=bool)
        toks: list[np.ndarray] = []
        appended: list[list[int]] = []
        for j, r in enumerate(running):
            req = requests[r]
            t = t_of[r]
            if t == 0:
                after_prefill[j] = True
                appended.append([int(req.output[0])])
            else:
                a = req.accepted[t - 1]
                acc[j], rej[j] = 1 + a, k - a
                c = com_of[r]
                toks.append(req.output[c : c + 1 + a])
                com_of[r] = c + 1 + a
                g = gen_of[r] - 1 - a
                appended.append(req.output[g : g + 1 + a].tolist())
            # This step decodes: after it, the request has generated 1 + a_t more tokens.
            gen_of[r] += 1 + req.accepted[t]
            t_of[r] = t + 1
            need = blocks_for(req.prompt.size + com_of[r] + (1 + k) + k, bs)
            total_blocks += max(need - blocks_of[r], 0)
            blocks_of[r] = max(need, blocks_of[r])
        batch = np.array(running, dtype=np.int64)
        admits: list[int] = []
        while len(running) < cfg.batch:
            r = len(requests)
            req = make_request(cfg, r, shared)
            requests.append(req)
            running.append(r)
            admits.append(r)
            t_of[r], gen_of[r], com_of[r] = 0, 1, 0
            blocks_of[r] = blocks_for(req.prompt.size + k, bs)
            total_blocks += blocks_of[r]
            digest = mix64(digest ^ (r + 1) ^ (int(req.prompt.size) << 32) ^ (int(req.prompt.astype(np.uint64).sum()) << 40))
        for r in finishes:
            digest = mix64(digest ^ (r + 1) ^ (1 << 63))
            del t_of[r], gen_of[r], com_of[r], blocks_of[r]
        tok_arr = np.concatenate(toks) if toks else np.zeros(0, dtype=np.uint32)
        digest = mix64(digest ^ n ^ (int(acc.astype(np.uint64).sum()) << 20) ^ (int(tok_arr.astype(np.uint64).sum()) << 24))
        peak = max(peak, sum(blocks_of.values()))
        steps.append(Step(finishes, batch, acc, rej, tok_arr, admits, appended, after_prefill))
        request_steps += n + len(admits)
    return Trace(cfg, requests, steps, request_steps, digest,
                 roomy_blocks=total_blocks + 64, tight_blocks=peak + 64, peak_blocks=peak)
