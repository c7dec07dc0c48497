"""The parser every command shares (addon/cli/parsing.py) and how cli.py builds it from the
command modules."""

from __future__ import annotations

import argparse

import pytest

from addon.cli import cli, report
from addon.cli.parsing import Parser, common, global_options, group


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _parser() -> Parser:
    shared = common()
    parser = Parser(prog="credproxy")
    global_options(parser, None)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    thing = group(sub, "thing", "things")
    thing.add_parser("list", parents=[shared], help="every thing")
    return parser


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--db", "sqlite:///a.db", "thing", "list"], id="a global option before"),
        pytest.param(["thing", "list", "--db", "sqlite:///a.db"], id="a global option after"),
    ],
)
def test_a_global_option_is_read_before_or_after_the_command(argv: list[str]) -> None:
    args = _parser().parse_args(argv)
    assert (args.db, args.command, args.action) == ("sqlite:///a.db", "thing", "list")


def test_a_global_option_not_given_keeps_the_top_levels_default() -> None:
    args = _parser().parse_args(["thing", "list"])
    assert (args.db, args.json) == (None, False)


def test_a_usage_error_is_raised_with_the_subcommands_name() -> None:
    with pytest.raises(report.UsageError) as caught:
        _parser().parse_args(["thing"])  # no action
    assert caught.value.prog == "credproxy thing"


def test_each_light_module_registers_its_command_and_only_it() -> None:
    for module in cli.LIGHT:
        parser = Parser(prog="credproxy")
        module.register(parser.add_subparsers(parser_class=Parser), common())
        assert list(_commands(parser)) == [module.COMMAND], module.__name__


def test_every_command_the_parser_can_run_has_a_handler() -> None:
    def leaves(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return [parser]
        return [leaf for p in subs[0].choices.values() for leaf in leaves(p)]

    unhandled = [p.prog for p in leaves(cli.build_parser()) if not callable(p.get_default("func"))]
    assert unhandled == []
