"""The manual matches the parsers: every command and flag README.md and docs/cli.md show exists, and every
command the parsers have is documented in both."""

from __future__ import annotations

import re

import pytest
from paths import ROOT

ROOT = ROOT
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
COMMAND = re.compile(r"\bspecdec(?:-export|\s+([a-z]+))")


def parsers() -> dict:
    """command -> its argparse parser ("specdec-export" for the exporter)."""
    from specdec.cli.main import build_parser
    from specdec.export.cli import build_parser as export_parser

    main = build_parser()
    found = {"specdec-export": export_parser()}
    for action in main._subparsers._group_actions:
        found.update(action.choices)
    return found


def flags_of(parser) -> set:
    return set(parser._option_string_actions)


def code_lines(text: str) -> list[str]:
    """The code in markdown ``text``: each line of a fenced block, and each `inline span` of the other lines;
    quoted strings dropped (a flag inside a value, as ``--llama-args "--no-repack"``, is not the command's)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        for code in [line] if fenced else re.findall(r"`([^`]+)`", line):
            lines.append(re.sub(r"\"[^\"]*\"", "", code))
    return lines


def documented(text: str, section_command: str | None = None) -> list[tuple[str, str]]:
    """(command, flag) pairs in the code of ``text``: on a line naming ``specdec CMD`` (or ``specdec-export``),
    its flags belong to that command; inside a section headed by a command, every flag belongs to it."""
    pairs = []
    for line in code_lines(text):
        commands = [("specdec-export" if m.group(1) is None else m.group(1)) for m in COMMAND.finditer(line)]
        owner = commands[-1] if commands else section_command
        if owner is not None:
            pairs += [(owner, flag) for flag in FLAG.findall(line)]
    return pairs


def cli_sections() -> dict:
    """docs/cli.md: command -> the text of its ``## specdec CMD`` section."""
    text = (ROOT / "docs" / "cli.md").read_text()
    sections = {}
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        heading, _, body = block.partition("\n")
        match = re.fullmatch(r"specdec(?:-export| ([a-z]+))", heading.strip())
        if match:
            sections["specdec-export" if match.group(1) is None else match.group(1)] = body
    return sections


def unknown_flags(pairs: list, known: dict) -> list:
    return sorted({f"{command} {flag}" for command, flag in pairs
                   if command in known and flag not in flags_of(known[command])} |
                  {f"specdec {command} (no such command)" for command, _ in pairs if command not in known})


def test_every_flag_the_manual_shows_exists():
    known = parsers()
    pairs = documented((ROOT / "README.md").read_text())
    for command, body in cli_sections().items():
        pairs += documented(body, command)
    assert unknown_flags(pairs, known) == []


def test_every_command_is_in_the_readme_table_and_has_a_cli_section():
    known = set(parsers())
    readme = (ROOT / "README.md").read_text()
    table = {m.group(1) or "specdec-export" for m in re.finditer(r"^\| `specdec(?:-export| ([a-z]+))", readme, re.M)}
    assert known - table == set(), "commands missing from the README's CLI table"
    assert known - set(cli_sections()) == set(), "commands without a section in docs/cli.md"


@pytest.mark.parametrize("line, expected", [
    ("`specdec serve BUNDLE --workers 2 --no-such-flag`", ["serve --no-such-flag"]),
    ("```\nspecdec frobnicate --x\n```", ["specdec frobnicate (no such command)"]),
])
def test_the_check_catches_a_flag_or_command_that_does_not_exist(line, expected):
    """Planted: a made-up flag and a made-up command are both reported."""
    assert unknown_flags(documented(line), parsers()) == expected
