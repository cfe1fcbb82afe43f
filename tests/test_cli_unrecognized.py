"""An argument a command does not know is that command's error, as its other argument errors
are: argparse's top-level parser reported it, as ``kvslots: error: unrecognized arguments: X
(see kvslots --help)``, which names no command and sends the user to the wrong --help."""

from __future__ import annotations

import pytest

from kvslots import cli


@pytest.mark.parametrize("argv, prog, extras", [
    (["simulate", "--bogus"], "kvslots simulate", "--bogus"),
    (["convert-config", "a.yaml", "b.yaml"], "kvslots convert-config", "b.yaml"),
    (["demo", "--bogus", "x"], "kvslots demo", "--bogus x"),
    (["--bogus"], "kvslots", "--bogus"),  # no command: the top level's
    # Before the command: the top level's (the command's --help does not list them).
    (["--bogus", "simulate"], "kvslots", "--bogus"),
    (["--bogus", "--x=1", "simulate", "--requests", "2"], "kvslots", "--bogus --x=1"),
    # And the command's own after it, named too (only --bogus was).
    (["--bogus", "simulate", "--other"], "kvslots", "--bogus (and --other, unknown to kvslots simulate)"),
    (["--bogus", "simulate", "--requests", "2", "--x", "y"], "kvslots", "--bogus (and --x y, unknown to kvslots simulate)"),
    (["simulate", "--bogus", "simulate"], "kvslots simulate", "--bogus simulate"),
])
def test_unrecognized_arguments_are_the_commands_error(capsys, argv, prog, extras):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"{prog}: error: unrecognized arguments: {extras} (see {prog} --help)\n", err


def test_known_arguments_still_run(capsys):
    assert cli.main(["simulate", "--requests", "2", "--batch", "2", "--json"]) == 0
    assert '"completed": 2' in capsys.readouterr().out
