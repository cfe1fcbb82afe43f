"""The simulated EAGLE workload (the CLI's `simulate`) runs to completion under memory pressure."""

import json

from kvslots.cli import main
from kvslots._dev.simulate import SimConfig, run


def test_simulation_completes_with_preemption_and_eviction():
    rep = run(SimConfig(requests=40, batch=16, num_blocks=200, seed=3))
    assert rep.completed == 40
    assert rep.preemptions > 0 and rep.stats["evicted_blocks"] > 0
    assert rep.final["held"] == 0 and rep.final["slots"] == 0
    assert 0.3 < rep.acceptance_rate < 0.7  # p=0.7 per draft, K=3: E[accepted]/K ~ 0.53
    assert rep.events["BlockStored"] > 0 and rep.events["BlockRemoved"] > 0


def test_cli_json(capsys):
    assert main(["simulate", "--requests", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["completed"] == 8 and out["stats"]["committed_blocks"] > 0
