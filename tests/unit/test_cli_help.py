"""`--help` and shell completion answer without loading torch, show defaults, and list
only the flags a command uses."""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import subprocess
import sys

import pytest

from disttrain.cli import COMMANDS, HelpFormatter, main

# Runs in a fresh interpreter where importing torch raises: building the parser, every
# command's help and the completion scripts must not need it.
NO_TORCH = """
import contextlib, io, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported while answering --help: " + name)

sys.meta_path.insert(0, NoTorch())
from disttrain.cli import COMMANDS, main
for argv in [["--help"], *([name, "--help"] for name in COMMANDS)]:
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        main(argv)
    assert "usage: disttrain" in out.getvalue(), argv
for shell in ("bash", "zsh", "tcsh"):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["completion", shell]) == 0
    assert "disttrain" in out.getvalue()
print("no torch:", not any(name.split(".")[0] == "torch" for name in sys.modules))
"""


def test_help_and_completion_do_not_import_torch():
    result = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("no torch: True")


def help_of(command: str) -> str:
    with contextlib.redirect_stdout(io.StringIO()) as out, pytest.raises(SystemExit):
        main([command, "--help"])
    return out.getvalue()


def test_help_shows_config_defaults_and_plain_defaults():
    text = " ".join(help_of("baseline").split())
    assert "[training.batch_size = 64]" in text
    assert "[training.dataset = digits]" in text
    # a switch's default (off) and a flag without one say nothing
    assert "(default: False)" not in text and "(default: None)" not in text


def test_help_formatter_adds_a_default_the_help_does_not_give():
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    parser.add_argument("--every", type=float, default=2.5, help="seconds between polls")
    parser.add_argument("--shard", default="0/1", help="which shard (default 0/1)")
    parser.add_argument("--quiet", action="store_true", help="say less")
    text = " ".join(parser.format_help().split())
    assert "seconds between polls (default: 2.5)" in text
    assert "which shard (default 0/1)" in text and "(default: 0/1)" not in text
    assert "say less" in text and "(default: False)" not in text


@pytest.mark.parametrize("command, absent", [
    ("baseline", ["--aggregation-mode", "--world-size", "--token-file", "--compression-type"]),
    ("evaluate", ["--resume", "--checkpoint-dir", "--log-dir", "--batch-size", "--inject"]),
    ("ps-worker", ["--world-size", "--backend", "--bind"]),
    ("ddp", ["--aggregation-mode", "--staleness", "--servers"]),
    ("status", ["--resume", "--batch-size"]),
    ("configs", ["--batch-size", "--resume"]),
    ("coordinator", ["--kill-at-step", "--inject-fault", "--batch-size"]),
    ("ps", ["--inject-fault"]),
    ("advise", ["--resume", "--inject", "--checkpoint-dir", "--num-epochs", "--precision"]),
])
def test_help_lists_only_the_flags_a_command_uses(command, absent):
    text = help_of(command)
    for flag in absent:
        assert f"{flag} " not in text and f"{flag}\n" not in text, f"{command} --help lists {flag}"


@pytest.mark.parametrize("command", ["baseline", "ps", "ps-server", "ps-worker", "ddp", "coordinator"])
def test_every_role_takes_faults_with_the_one_flag(command):
    text = help_of(command)
    assert "--inject SPEC" in text and "--fault-plan FILE" in text, command


def test_train_says_it_passes_the_other_flags_on():
    text = " ".join(help_of("train").split())
    assert "Every other flag is passed on, unchanged, to that command" in text
    assert "parameter_server `disttrain ps`" in text and "[FLAGS OF THAT COMMAND...]" in text


def test_every_command_has_help_and_a_completion_entry():
    script = subprocess.run([sys.executable, "-m", "disttrain", "completion", "bash"], capture_output=True,
                            text=True, timeout=120, check=True).stdout
    for name in COMMANDS:
        assert name in script


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to load the completion script")
def test_bash_completion_completes_commands_and_flags():
    script = subprocess.run([sys.executable, "-m", "disttrain", "completion", "bash"], capture_output=True,
                            text=True, timeout=120, check=True).stdout
    probe = script + """
COMP_WORDS=(disttrain ps-w); COMP_CWORD=1; COMP_LINE="disttrain ps-w"; COMP_POINT=${#COMP_LINE}
_shtab_disttrain; echo "commands: ${COMPREPLY[*]}"
COMP_WORDS=(disttrain ps-worker --serv); COMP_CWORD=2; COMP_LINE="disttrain ps-worker --serv"
COMP_POINT=${#COMP_LINE}; _shtab_disttrain; echo "flags: ${COMPREPLY[*]}"
"""
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=60).stdout
    assert "commands: ps-worker" in out
    assert "flags: --servers" in out
