"""Commands are values: rendered strings are exact, every argument quoted, secrets never on a command line."""

from __future__ import annotations

import subprocess

import pytest

from mnft.core.errors import InputError
from mnft.hosts.command import Command, is_secret_name, quote_path, redact_env

INJECTIONS = [
    "; touch {marker}",
    "$(touch {marker})",
    "`touch {marker}`",
    "a\ntouch {marker}",
    "' ; touch {marker}; '",
    '" ; touch {marker}; "',
    "&& touch {marker}",
    "| touch {marker}",
    "x y  z",
    "$HOME ${{IFS}}touch${{IFS}}{marker}",
]


def test_rendering_is_exact():
    cmd = Command.of("python3", "-m", "mnft.recipes.lora", "lr=1e-4", "name=my run", env={"A": "1", "B": "x y"}, cwd="~/mnft")
    assert cmd.render() == "cd -- \"$HOME\"/mnft && env A=1 B='x y' python3 -m mnft.recipes.lora lr=1e-4 'name=my run'"
    assert cmd.sh() == "sh -c 'cd -- \"$HOME\"/mnft && env A=1 B='\"'\"'x y'\"'\"' python3 -m mnft.recipes.lora lr=1e-4 '\"'\"'name=my run'\"'\"''"


def test_home_relative_paths_keep_meaning_home_but_nothing_else_expands():
    assert quote_path("~/a b") == "\"$HOME\"/'a b'"
    assert quote_path("~") == '"$HOME"'
    assert quote_path("~root/x") == "'~root/x'"
    assert quote_path("/$(id)") == "'/$(id)'"


@pytest.mark.parametrize("payload", INJECTIONS)
def test_injection_payloads_are_data_in_one_and_two_shell_layers(tmp_path, payload):
    marker = tmp_path / "pwned"
    value = payload.format(marker=marker)
    cmd = Command.of("printf", "%s", value, env={"V": value})
    for line in (cmd.render(), cmd.sh()):
        out = subprocess.run(["/bin/sh", "-c", line], capture_output=True, text=True, check=True)
        assert out.stdout == value
        assert not marker.exists()


def test_settings_that_merely_begin_with_a_secret_word_are_not_secrets():
    for name in ("TOKENIZERS_PARALLELISM", "KEYBOARD_LAYOUT", "PASSWORDLESS_LOGIN"):
        assert not is_secret_name(name)


@pytest.mark.parametrize("name", ["HF_TOKEN", "WANDB_API_KEY", "aws_secret_access_key", "DB_PASSWORD", "APIKEY", "SSH_KEYS", "GH_CREDENTIALS"])
def test_secret_named_variables_never_go_on_a_command_line(name):
    assert is_secret_name(name)
    with pytest.raises(InputError, match=f"{name} looks secret"):
        Command.of("true", env={name: "hunter2"})
    assert redact_env({name: "hunter2", "LR": "1"}) == {name: "***", "LR": "1"}


@pytest.mark.parametrize("name", ["1X", "A-B", "A B", "X;id", ""])
def test_invalid_environment_names_are_refused(name):
    with pytest.raises(InputError, match="environment variable name"):
        Command.of("true", env={name: "1"})


def test_a_command_line_shown_to_a_person_can_be_pasted_into_a_shell_on_the_host():
    from mnft.hosts.command import shell_line

    argv = ["~/mnft/runs/R/entry.py", "checkpointer.checkpoint_files=[model.pt]", "output_dir=~/mnft/outputs/J", "two words", "it's", "[/b]"]
    line = shell_line(argv)
    assert line == ('"$HOME"/mnft/runs/R/entry.py \'checkpointer.checkpoint_files=[model.pt]\' output_dir="$HOME"/mnft/outputs/J '
                    "'two words' 'it'\"'\"'s' '[/b]'")
    home = subprocess.run(["sh", "-c", "printf '%s\\n' " + line], capture_output=True, text=True, env={"HOME": "/h"}).stdout.splitlines()
    assert home == ["/h/mnft/runs/R/entry.py", "checkpointer.checkpoint_files=[model.pt]", "output_dir=/h/mnft/outputs/J", "two words", "it's", "[/b]"]
