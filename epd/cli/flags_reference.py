"""docs/flags.md, written from the argparse definitions themselves (`render`), so the
reference cannot drift from `epd ... --help`: every command's flags, grouped as its parser
groups them, each with its default and help text.

    python -m epd.cli.flags_reference            # rewrite docs/flags.md
    python -m epd.cli.flags_reference --check    # exit 1 when docs/flags.md is stale

It reads the parsers through argparse's own attributes (`_actions`, `_action_groups`,
the help formatter's `_expand_help`), as `--help` does: public argparse has no walk.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
COMMAND = "python -m epd.cli.flags_reference"
_HEADER = f"""# Flags reference

Every flag of every `epd` command with its default, generated from the argparse
definitions by `{COMMAND}`: do not edit by hand (a test fails when
this page and the parsers differ). What the flags are for, by topic:
[usage.md](usage.md); the same text on the command line: `epd serve --help`.
"""


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole reference page for the `epd` parser (default: `epd.cli.build_parser()`)."""
    if parser is None:
        from epd.cli import build_parser  # here, not at import: epd.cli imports this module's siblings

        parser = build_parser()
    sections = [_HEADER]
    for name, command, about in _commands(parser):
        sections.append(_command_section(name, command, about))
    return "\n".join(sections)


def _commands(parser: argparse.ArgumentParser, prefix: str = "epd") -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(`epd serve`, its parser, its one-line help), ... depth first in `--help`'s order;
    a command with sub-commands (`epd bench`) is listed through them."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                nested = _commands(sub, f"{prefix} {name}")
                found.extend(nested or [(f"{prefix} {name}", sub, helps.get(name) or "")])
    return found


def _command_section(name: str, parser: argparse.ArgumentParser, about: str) -> str:
    lines = [f"## `{name}`", ""]
    if about:
        lines += [" ".join(about.split()), ""]
    formatter = argparse.HelpFormatter(parser.prog)  # the plain one: the help as written, no default appended
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS
                   and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]
        if not actions:
            continue
        lines += [f"### {group.title}", ""]
        lines += [_flag_line(formatter, a) for a in actions]
        lines.append("")
    return "\n".join(lines)


def _flag_line(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    """One list item: a flag's names with its value, its default and its help; a positional's name and help."""
    if action.option_strings:
        value = "" if action.nargs == 0 else " " + formatter._format_args(
            action, formatter._get_default_metavar_for_optional(action))
        names = ", ".join(f"`{name}{value}`" for name in action.option_strings)
        default = "" if action.default == argparse.SUPPRESS else f" (default: `{action.default}`)"
    else:
        names, default = f"`{action.dest}`", ""
    text = " ".join(formatter._expand_help(action).split()) if action.help else ""
    return f"- {names}{default}: {text}" if text else f"- {names}{default}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Write docs/flags.md from the `epd` parsers.")
    parser.add_argument("--check", action="store_true", help="only compare: exit 1 when docs/flags.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
