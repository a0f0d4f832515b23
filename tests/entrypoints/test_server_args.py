"""One flag generator for the server and the CLI, one home for each default (issue 23)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from radixserve.core.config import EngineConfig
from radixserve.entrypoints import cli
from radixserve.entrypoints.admission import Limits
from radixserve.entrypoints.server_args import ServerArgs, build_parser, parse_server_args


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def test_every_field_is_a_flag_with_help() -> None:
    actions = _actions(build_parser())
    for cls, skip in ((ServerArgs, {"engine"}), (EngineConfig, set())):
        for f in dataclasses.fields(cls):
            if f.name not in skip:
                assert f.name in actions and len(actions[f.name].help or "") > 5, f.name


def test_no_flags_give_the_dataclass_defaults() -> None:
    args = parse_server_args([])
    assert args == ServerArgs(engine=EngineConfig())


def test_limit_defaults_come_from_admission_limits() -> None:
    defaults = ServerArgs(engine=EngineConfig())
    # max_running_requests is the engine's setting; max_batch_chars is --max-body-bytes
    server_field = {"max_batch_chars": "max_body_bytes"}
    for f in dataclasses.fields(Limits):
        if f.name != "max_running_requests":
            assert getattr(defaults, server_field.get(f.name, f.name)) == f.default, f.name


def test_serve_and_generate_build_engine_flags_alike() -> None:
    serve = _actions(build_parser())
    generate = argparse.ArgumentParser()
    cli.add_engine_config_args(generate)
    for dest, action in _actions(generate).items():
        twin = serve[dest]
        assert (action.option_strings, action.type, action.help) == (
            twin.option_strings,
            twin.type,
            twin.help,
        ), dest
        assert action.default is argparse.SUPPRESS  # EngineConfig's defaults apply


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--dtype", "fp8"], "unknown dtype 'fp8'"),
        (["--max-n", "0"], "--max-n must be >= 1"),
        (["--port", "99999"], "--port must be in [0, 65535], got 99999"),
        (["--port", "-1"], "--port must be in [0, 65535], got -1"),
    ],
)
def test_bad_values_are_one_argparse_error(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_server_args(argv)
    assert fragment in capsys.readouterr().err
