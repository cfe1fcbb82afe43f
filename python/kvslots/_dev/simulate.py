"""``kvslots simulate``: a simulated EAGLE workload driven through the slot manager's batch API.

Requests arrive with prompts (some sharing a prefix), are admitted up to the batch size, prefill,
then decode with K draft tokens per step: each draft is accepted with a fixed probability until
the first rejection, the verified tokens are committed, the rejected drafts rolled back, and the
next step's 1 + K positions plus K lookahead reserved, for the whole batch in one call. When the
pool runs dry the newest running request is preempted and requeued, as vLLM does.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from .. import _args
from ..errors import ArgumentTypeError, InvalidArgumentError, OutOfBlocksError
from ..events import AllBlocksCleared, BlockRemoved, BlockStored
from ..slots import SlotManager


@dataclass
class SimConfig:
    requests: int = 64
    batch: int = 16
    lookahead: int = 3
    acceptance: float = 0.7
    block_size: int = 16
    num_blocks: int = 1024
    prompt_min: int = 64
    prompt_max: int = 512
    shared_prefix: int = 256
    shared_fraction: float = 0.3
    output_min: int = 32
    output_max: int = 128
    vocab: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        # Checked before anything runs: a batch of 0 never admitted a request (a hang), a negative
        # seed was numpy's ValueError. Bounds keep a run finite and its arrays small.
        for name, lo, hi in _INT_FIELDS:
            _args.integer(getattr(self, name), name, lo, hi)
        for name in ("acceptance", "shared_fraction"):
            _args.number(getattr(self, name), name, 0.0, 1.0)
        if self.prompt_max < self.prompt_min:
            raise InvalidArgumentError(f"prompt_max {self.prompt_max} is below prompt_min {self.prompt_min}")
        if self.output_max < self.output_min:
            raise InvalidArgumentError(f"output_max {self.output_max} is below output_min {self.output_min}")


#: (field, lowest, highest) of SimConfig's integers.
_INT_FIELDS = (("requests", 0, 100_000), ("batch", 1, 4096), ("lookahead", 0, 64), ("block_size", 1, 4096),
               ("num_blocks", 1, 1 << 24), ("prompt_min", 1, 1 << 16), ("prompt_max", 1, 1 << 16),
               ("shared_prefix", 0, 1 << 16), ("output_min", 1, 1 << 16), ("output_max", 1, 1 << 16),
               ("vocab", 1, 1 << 32), ("seed", 0, (1 << 64) - 1))


@dataclass
class _Req:
    rid: str
    prompt: np.ndarray
    output_len: int


@dataclass
class SimReport:
    config: SimConfig
    steps: int = 0
    completed: int = 0
    preemptions: int = 0
    generated_tokens: int = 0
    drafted_tokens: int = 0
    accepted_drafts: int = 0
    seconds: float = 0.0
    stats: dict[str, int] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)
    final: dict[str, int] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        return self.generated_tokens / max(self.steps, 1)


def run(cfg: SimConfig) -> SimReport:
    if not isinstance(cfg, SimConfig):  # its fields were read: an AttributeError
        raise ArgumentTypeError(f"cfg must be a SimConfig, got {type(cfg).__name__}")
    # Its fields as they are now: a SimConfig is mutable, and cfg.batch = 0 set after it was
    # made ran for ever.
    cfg.__post_init__()
    rng = np.random.default_rng(cfg.seed)
    shared = rng.integers(0, cfg.vocab, cfg.shared_prefix, dtype=np.uint32)
    waiting: deque[_Req] = deque()
    for i in range(cfg.requests):
        n = int(rng.integers(cfg.prompt_min, cfg.prompt_max + 1))
        prompt = rng.integers(0, cfg.vocab, n, dtype=np.uint32)
        if rng.random() < cfg.shared_fraction and n > cfg.shared_prefix:
            prompt[: cfg.shared_prefix] = shared
        waiting.append(_Req(f"req-{i}", prompt, int(rng.integers(cfg.output_min, cfg.output_max + 1))))

    m = SlotManager(cfg.num_blocks, cfg.block_size)
    rep = SimReport(cfg)
    events: Counter[str] = Counter()
    running: list[_Req] = []
    # Per running request, in running's order, as arrays (a step's bookkeeping is a few numpy
    # calls, not a Python loop per request and a slot id looked up again per request and step):
    # tokens generated, tokens to generate, slot id.
    generated = np.zeros(0, np.int64)
    output_len = np.zeros(0, np.int64)
    slot_ids = np.zeros(0, np.uint64)
    k = cfg.lookahead
    new_tokens = np.full(cfg.batch, 1 + k, dtype=np.uint32)  # each step's 1 + K positions, read-only
    new_tokens.flags.writeable = False
    t0 = time.perf_counter()

    while waiting or running:
        # Admit and prefill: the prompt's KV is computed and verified in one go.
        admitted: list[_Req] = []
        while waiting and len(running) < cfg.batch:
            req = waiting.popleft()
            matched = m.create(req.rid, req.prompt, lookahead=k)
            try:
                m.reserve(req.rid, len(req.prompt) - matched + 1 + k)
            except OutOfBlocksError:
                m.finish(req.rid)
                waiting.appendleft(req)
                if not running:
                    raise
                break
            m.commit(req.rid, req.prompt[matched:])
            running.append(req)
            admitted.append(req)
        if admitted:  # a preempted request starts again from its prompt: 0 generated
            generated = np.concatenate([generated, np.zeros(len(admitted), np.int64)])
            output_len = np.concatenate([output_len, np.array([r.output_len for r in admitted], np.int64)])
            slot_ids = np.concatenate([slot_ids, np.array([m.slot_id(r.rid) for r in admitted], np.uint64)])
        # Verify this step's drafts: each accepted with probability p until the first rejection.
        n = len(running)
        # A rejected column after the K drafts: the first rejection's index is the number accepted.
        draws = np.zeros((n, k + 1), dtype=bool)
        np.less(rng.random((n, k)), cfg.acceptance, out=draws[:, :k])
        accepted = draws.argmin(axis=1)
        num_accepted = 1 + accepted  # the token sampled last step plus the accepted drafts
        total = int(num_accepted.sum())
        tokens = rng.integers(0, cfg.vocab, total, dtype=np.uint32)
        rep.steps += 1
        rep.drafted_tokens += k * n
        rep.accepted_drafts += total - n
        rep.generated_tokens += total
        generated += num_accepted
        finished = generated >= output_len
        if finished.any():
            # Finished requests: commit and leave. The rest: one batch step.
            offsets = np.concatenate([[0], np.cumsum(num_accepted)])
            for j in np.flatnonzero(finished).tolist():
                req = running[j]
                m.commit(req.rid, tokens[offsets[j] : offsets[j + 1]])
                m.finish(req.rid)
                rep.completed += 1
            keep = ~finished
            running = [r for r, kept in zip(running, keep.tolist()) if kept]
            tokens = tokens[np.repeat(keep, num_accepted)]
            num_accepted, accepted = num_accepted[keep], accepted[keep]
            generated, output_len, slot_ids = generated[keep], output_len[keep], slot_ids[keep]
        if running:
            acc = num_accepted.astype(np.uint32)
            rej = (k - accepted).astype(np.uint32)
            new = new_tokens[: len(running)]
            while True:
                try:
                    m.step(slot_ids, acc, tokens, rej, new)
                    break
                except OutOfBlocksError as e:
                    if len(running) == 1:  # alone, every other block is free or evictable: requeued, it would loop forever
                        raise InvalidArgumentError(
                            f"num_blocks {cfg.num_blocks} is too small: request {running[0].rid} cannot finish "
                            f"even alone ({e})") from None
                    # Commit what was verified, then free the newest request (it starts again
                    # from its prompt, as vLLM's recompute preemption does) and retry.
                    victim = running.pop()
                    m.finish(victim.rid)
                    waiting.appendleft(victim)
                    rep.preemptions += 1
                    tokens = tokens[: len(tokens) - int(acc[-1])]
                    acc, rej, new = acc[:-1], rej[:-1], new[:-1]
                    generated, output_len, slot_ids = generated[:-1], output_len[:-1], slot_ids[:-1]
                    if not running:
                        break
        if rep.steps % 64 == 0:  # counted by kind from the core's own tuples (no event structs made)
            events.update([raw[0] for raw in m.drain_raw_events()])
    events.update([raw[0] for raw in m.drain_raw_events()])
    rep.seconds = time.perf_counter() - t0
    rep.stats = m.stats()
    rep.events = {n: events[n] for n in (BlockStored.__name__, BlockRemoved.__name__, AllBlocksCleared.__name__)}
    problem = m.check_invariants()
    if problem:
        raise AssertionError(f"invariant broken after simulation: {problem}")
    rep.final = {"free": m.num_free, "held": m.num_held, "cached": m.num_cached, "slots": len(m)}
    return rep


def format_report(rep: SimReport) -> str:
    c, s = rep.config, rep.stats
    lines = [
        f"simulated EAGLE workload: {c.requests} requests, batch {c.batch}, K={c.lookahead}, "
        f"per-draft acceptance {c.acceptance}, block size {c.block_size}, pool {c.num_blocks} blocks",
        f"  steps                 {rep.steps}",
        f"  completed requests    {rep.completed} ({rep.preemptions} preemptions)",
        f"  generated tokens      {rep.generated_tokens} ({rep.mean_accepted_per_step:.2f} per step, "
        f"draft acceptance {rep.acceptance_rate:.1%})",
        f"  prefix-cache hits     {s['prefix_hit_tokens']} tokens",
        f"  blocks committed      {s['committed_blocks']} ({s['registered_blocks']} registered as prefix cache)",
        f"  tokens rolled back    {s['rolled_back_tokens']}",
        f"  blocks allocated      {s['allocated_blocks']}, released {s['released_blocks']}, evicted {s['evicted_blocks']}",
        "  events                " + ", ".join(f"{k} {v}" for k, v in rep.events.items()),
        f"  pool at the end       free {rep.final['free']}, held {rep.final['held']}, cached {rep.final['cached']}",
        "  invariants            hold (checked after the run)",
        f"  wall time             {rep.seconds:.3f} s",
    ]
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = SimConfig()
    p = sub.add_parser("simulate", help="run a simulated EAGLE workload through the slot manager",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bounds = {name: (lo, hi) for name, lo, hi in _INT_FIELDS}

    def span(name: str) -> str:  # SimConfig's own bounds, as its errors state them
        return _args.span(*bounds[name])

    p.add_argument("--requests", type=int, default=d.requests,
                   help=f"requests in the workload ({span('requests')}; default %(default)s)")
    p.add_argument("--batch", type=int, default=d.batch,
                   help=f"max running requests ({span('batch')}; default %(default)s)")
    p.add_argument("--lookahead", "-k", type=int, default=d.lookahead,
                   help=f"draft tokens per step, K ({span('lookahead')}; default %(default)s)")
    p.add_argument("--acceptance", type=float, default=d.acceptance,
                   help="per-draft acceptance probability ([0, 1]; default %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help=f"tokens per KV block ({span('block_size')}; default %(default)s)")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks,
                   help=f"blocks in the pool ({span('num_blocks')}; default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"random seed of the prompts, lengths and acceptances ({span('seed')}; default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_main)


#: The flag each of SimConfig's fields is given by on the command line.
_FLAGS = {"requests": "--requests", "batch": "--batch", "lookahead": "--lookahead/-k", "acceptance": "--acceptance",
          "block_size": "--block-size", "num_blocks": "--num-blocks", "seed": "--seed"}


def _main(args: argparse.Namespace) -> int:
    # Checked here under the flags' names, as argparse names them (SimConfig's errors named its
    # fields: 'block_size must be in [1, 4096]' for --block-size 0).
    for name, lo, hi in _INT_FIELDS:
        if name in _FLAGS:
            _args.integer(getattr(args, name), _FLAGS[name], lo, hi)
    _args.number(args.acceptance, _FLAGS["acceptance"], 0.0, 1.0)
    cfg = SimConfig(requests=args.requests, batch=args.batch, lookahead=args.lookahead,
                    acceptance=args.acceptance, block_size=args.block_size,
                    num_blocks=args.num_blocks, seed=args.seed)
    rep = run(cfg)
    if args.json:
        out = {k: v for k, v in rep.__dict__.items() if k != "config"}
        out["config"] = cfg.__dict__
        out["acceptance_rate"] = rep.acceptance_rate
        print(json.dumps(out, indent=2))
    else:
        print(format_report(rep))
    return 0
