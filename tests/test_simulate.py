"""The simulated EAGLE workload (the CLI's `simulate`) runs to completion under memory pressure; bad
arguments are one line and exit 2, never a hang."""

import json

import pytest

from kvslots._dev.simulate import SimConfig, run
from kvslots.cli import main
from kvslots.errors import InvalidArgumentError


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


@pytest.mark.parametrize("argv, problem", [
    (["--batch", "0"], "error: --batch must be in [1, 4096], got 0"),  # was a hang: nothing was ever admitted
    (["--batch", "-1"], "error: --batch must be in"),
    (["--seed", "-1"], "error: --seed must be in [0, 2**64-1], got -1"),  # was numpy's ValueError
    (["--seed", str(2**64)], "error: --seed must be in"),
    (["--requests", "-1"], "error: --requests must be in"),
    (["--lookahead", "-1"], "error: --lookahead/-k must be in"),
    (["-k", "65"], "error: --lookahead/-k must be in"),
    (["--acceptance", "nan"], "error: --acceptance must be a finite number"),
    (["--acceptance", "1.5"], "error: --acceptance must be <= 1"),
    (["--block-size", "0"], "error: --block-size must be in"),  # named as the flag, not the field
    (["--num-blocks", "0"], "error: --num-blocks must be in"),
    (["--num-blocks", str(2**40)], "error: --num-blocks must be in"),
    (["--num-blocks", "10"], "num_blocks 10 is too small"),  # a request that cannot finish alone looped forever
    (["--num-blocks", "1"], "out of blocks"),
])
def test_cli_bad_arguments_are_one_line_exit_2(capsys, argv, problem):
    assert main(["simulate", "--requests", "8", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("kvslots simulate: error: "), err
    assert problem in err, err


def test_edge_values_run():
    assert run(SimConfig(requests=0)).completed == 0
    rep = run(SimConfig(requests=6, lookahead=0))
    assert rep.completed == 6 and rep.drafted_tokens == 0
    assert run(SimConfig(requests=4, batch=1, seed=2**64 - 1)).completed == 4


def test_config_is_checked_from_python_too():
    with pytest.raises(InvalidArgumentError, match="batch"):
        SimConfig(batch=0)
    with pytest.raises(InvalidArgumentError, match="prompt_max"):
        SimConfig(prompt_min=100, prompt_max=10)
    with pytest.raises(InvalidArgumentError, match="seed"):
        SimConfig(seed="1")


@pytest.mark.parametrize("cfg", [None, {"requests": 1}, "cfg", 5])
def test_run_needs_a_sim_config(cfg):
    from kvslots._dev.simulate import run
    from kvslots.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError):  # its fields were read: AttributeError
        run(cfg)


@pytest.mark.parametrize("dims", [(0, 128, 4, 2, 256), (2, 0, 4, 2, 256), (2, 128, 0, 2, 256), (2, 128, 4, 0, 256),
                                  (2, 128, 3, 1, 256), (2, 128, 4, 3, 256), (2, 128, 4, 2, -1), (2.0, 128, 4, 2, 256),
                                  (True, 128, 4, 2, 256), (2, 1 << 20, 4, 2, 256)])
def test_tiny_model_dimensions_are_checked(dims):
    from kvslots._dev.tiny import Dims
    from kvslots.errors import ConfigError

    with pytest.raises(ConfigError):  # 0 was a ZeroDivisionError while building
        Dims(*dims)


@pytest.mark.parametrize("argv, problem", [
    (["--heads", "0"], "Dims.heads: must be an integer in [1, 65536]"),
    (["--hidden", "abc"], "invalid int value"),
    (["--heads", "3"], "must be a multiple of heads"),
    (["/dev/null/x"], "cannot build the tiny models"),
])
def test_tiny_models_script_errors_are_one_line_exit_2(capsys, argv, problem):
    """``python -m kvslots._dev.tiny`` (docs/serve.md tells users to run it) errs as the kvslots
    commands do: one line, exit status 2, no traceback."""
    from kvslots._dev.tiny import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's errors exit from parse_args
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and err.startswith("python -m kvslots._dev.tiny: error: ") and problem in err, err


@pytest.mark.parametrize("root", [5, None, b"/tmp/x", ["/tmp/x"]])
def test_tiny_models_root_must_be_a_path(root):
    from kvslots._dev.tiny import build_tiny_models
    from kvslots.errors import ConfigError

    with pytest.raises(ConfigError):
        build_tiny_models(root)
