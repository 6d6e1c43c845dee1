"""docs/flags.md is what `python -m epd.cli.flags_reference` writes from the parsers
today: a flag added, removed or re-worded without regenerating the page fails here."""
from __future__ import annotations

from epd.cli import build_parser
from epd.cli.flags_reference import COMMAND, DOC, render


def test_docs_flags_md_is_current():
    assert DOC.read_text() == render(), f"docs/flags.md is stale: run `{COMMAND}`"


def test_every_command_and_flag_is_in_the_reference():
    text = render()
    for command in ("epd serve", "epd worker", "epd keys", "epd chat", "epd make-model", "epd bench serve",
                    "epd bench compare", "epd bench plan", "epd bench offline"):
        assert f"## `{command}`\n" in text, command
    # serve's parser groups its flags: the groups are headings, with their flags under them
    engine = text.index("## `epd serve`")
    assert text.index("### engine", engine) < text.index("`--max-num-seqs MAX_NUM_SEQS` (default: ", engine)
    assert "`--enable-tower-lora`, `--enable-tower-connector-lora` (default: `False`): " in text


def test_a_changed_help_text_changes_the_reference():
    parser = build_parser()
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    flag = next(a for a in serve._actions if "--max-num-seqs" in a.option_strings)
    flag.help = "a help text the page does not have"
    changed = render(parser)
    assert changed != render() and "`--max-num-seqs MAX_NUM_SEQS` (default: `256`): a help text the page does not have" in changed
