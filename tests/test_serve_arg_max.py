"""The vLLM command ``kvslots serve`` plans fits the system's limit on a program's arguments and
environment together (``getconf ARG_MAX``), not only each string its own (128 KiB): kvslots serve's
own arguments fit, and the flags the YAML adds pushed vLLM's past it, so a --dry-run printed a
command that could not run and a real run ended with "cannot start ...: Argument list too long",
exit status 127."""

from __future__ import annotations

import pytest

from kvslots import cli
from kvslots.config.vllm_args import arg_max, check_exec_strings
from kvslots.errors import KVSlotsError

LIMIT = arg_max()
STRING = 120_000  # under the 128 KiB one string may be

pytestmark = pytest.mark.skipif(LIMIT is None or not 2**20 <= LIMIT <= 16 * 2**20, reason="no ARG_MAX a test can reach")


def _argv(tmp_path) -> list[str]:
    # Arguments after -- just under the limit, and a YAML adding two strings of 120 KB.
    f = tmp_path / "e.yaml"
    f.write_text(f"model_kwargs: {{x: {'d' * STRING}}}\ntokenizer: /{'t' * STRING}\n")
    n = (LIMIT - 100_000) // (STRING + 20)
    return ["serve", "org/m", "--dry-run", "-q", "--extra-engine-args", str(f), "--",
            *(f"--x{i}={'a' * STRING}" for i in range(n))]


def test_a_vllm_command_past_arg_max_is_one_line_exit_2(tmp_path, capsys):
    argv = _argv(tmp_path)
    assert sum(len(a) + 9 for a in argv) < LIMIT  # kvslots serve itself could be started with them
    capsys.readouterr()
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err[:500]
    assert "this system passes at most" in err and "(getconf ARG_MAX)" in err, err[:500]


def test_check_exec_strings_counts_every_string_together():
    fits = ["x" * STRING] * ((LIMIT // 2) // (STRING + 9))
    check_exec_strings(fits)  # half the limit
    with pytest.raises(KVSlotsError, match="take .* bytes; this system passes at most"):
        check_exec_strings(fits, {f"V{i}": "y" * STRING for i in range(LIMIT // 2 // STRING + 2)})
