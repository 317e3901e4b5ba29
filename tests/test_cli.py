"""The command line's parsing: `logs`, `status` and `stop` take an optional RUN (default: the latest run)."""

from __future__ import annotations

import pytest
from invoke.exceptions import ParseError
from invoke.parser import Parser

import tasks


def parse(*argv: str) -> dict[str, dict]:
    contexts = Parser(contexts=tasks.ns.to_contexts()).parse_argv(list(argv))
    return {ctx.name: ctx.as_kwargs for ctx in contexts}


@pytest.mark.parametrize("name", ["logs", "status", "stop"])
def test_run_may_be_left_out_and_the_task_gets_its_default(name):
    assert parse(name)[name]["run"] is None


@pytest.mark.parametrize("name", ["logs", "status", "stop"])
def test_run_given_positionally_or_as_a_flag(name):
    assert parse(name, "20261122-185641-a51e")[name]["run"] == "20261122-185641-a51e"
    assert parse(name, "--run", "r1")[name]["run"] == "r1"


def test_flags_before_or_after_the_optional_run():
    only_flag = parse("logs", "-f")["logs"]
    assert only_flag["run"] is None and only_flag["follow"] is True
    assert parse("logs", "-f", "r1")["logs"]["run"] == "r1"
    assert parse("logs", "r1", "-f")["logs"]["follow"] is True


def test_other_tasks_still_parse_after_an_optional_run():
    parsed = parse("logs", "r1", "status")
    assert parsed["logs"]["run"] == "r1" and parsed["status"]["run"] is None


def test_a_required_positional_of_plain_invoke_is_still_required():
    from invoke import Collection, task

    @task(positional=["name"])
    def needs(c, name):
        pass

    with pytest.raises(ParseError, match="did not receive required positional"):
        Parser(contexts=Collection(needs).to_contexts()).parse_argv(["needs"])
