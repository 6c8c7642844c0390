"""MkDocs hook: the manual's generated parts, made from fedray's own listing code so that they cannot drift.

A page asks for a part with an HTML comment on a line of its own:

- ``<!-- fedray:methods -->``: what ``fedray methods`` prints (every built-in and its options);
- ``<!-- fedray:options run -->``: a command's options (here ``fedray run``'s), one table per ``--help`` group, read
  from the command line's own parser (``fedray.app.cli.build_parser``); any command path works
  (``<!-- fedray:options data export -->``);
- ``<!-- fedray:api -->``: an API reference entry (mkdocstrings) for each name of the public interface,
  ``fedray/__init__.py``'s;
- ``<!-- fedray:layout -->``: every module of ``fedray/``, by package, with the first line of its docstring.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROLE = re.compile(r":[a-z]+:`~?(?P<code>[^`]+)`")
MARKER = re.compile(r"^<!-- fedray:(?P<part>[a-z-]+)(?P<args>(?: [\w-]+)*) -->$", re.MULTILINE)


def on_config(config: object) -> object:
    """This checkout's ``fedray`` first on the path, whichever directory ``mkdocs`` runs from."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return config


def on_page_markdown(markdown: str, page: object, config: object, files: object) -> str:
    return MARKER.sub(lambda match: _part(match["part"], match["args"].split()), markdown)


def _part(part: str, args: list[str]) -> str:
    makers = {"methods": _methods, "options": _options, "api": _api, "layout": _layout}
    if part not in makers:
        raise ValueError(f"unknown generated part <!-- fedray:{part} -->; known: {', '.join(makers)}")
    return makers[part](*args)


def _methods() -> str:
    """``fedray methods``' output, as the command prints it."""
    from fedray.app.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["methods"])
    if code != 0:
        raise RuntimeError(f"fedray methods exited with {code}")
    return f"```text\n{printed.getvalue().rstrip()}\n```\n"


def _options(*command: str) -> str:
    """One table per argument group of ``fedray COMMAND --help``: each option, its value and its help."""
    from fedray.app.cli import build_parser

    parser = _subparser(build_parser(), command)
    formatter = parser.formatter_class(prog=parser.prog)
    sections = []
    for group in parser._action_groups:
        rows = [_option_row(action, formatter) for action in group._group_actions
                if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)]
        if rows:
            title = "options" if group.title in ("options", "optional arguments") else group.title
            sections.append(f"### {_escaped(title)}\n\n| option | value | |\n|---|---|---|\n" + "\n".join(rows) + "\n")
    return "\n".join(sections)


def _subparser(parser: argparse.ArgumentParser, command: tuple[str, ...]) -> argparse.ArgumentParser:
    for word in command:
        choices = next(action.choices for action in parser._actions if isinstance(action, argparse._SubParsersAction))
        parser = choices[word]
    return parser


def _option_row(action: argparse.Action, formatter: argparse.HelpFormatter) -> str:
    flags = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.metavar or action.dest}`"
    if action.nargs == 0:
        value = ""
    elif action.choices:
        value = " \\| ".join(f"`{choice}`" for choice in action.choices)
    else:
        value = f"`{action.metavar or action.dest.upper()}`"
    return f"| {flags} | {value} | {_escaped(formatter._expand_help(action))} |"


def _escaped(text: str) -> str:
    """Text for a Markdown table cell, on one line: reST's ``code`` and :role:`code` as code spans, no pipes, and
    outside code no HTML and no emphasis by accident."""
    text = ROLE.sub(r"`\g<code>`", " ".join(text.split()).replace("``", "`"))
    pieces = text.split("`")
    for index in range(0, len(pieces), 2):  # the even pieces lie outside code spans
        pieces[index] = (pieces[index].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                         .replace("*", "\\*").replace("_", "\\_"))
    return "`".join(pieces).replace("|", "\\|")


def _api() -> str:
    """``fedray.NAME`` for each public name, documented from the module that defines it."""
    import fedray

    return "\n".join(f"## `fedray.{name}`\n\n::: {fedray._EXPORTS[name]}.{name}\n    options:\n"
                     f"      show_root_heading: false\n" for name in fedray.__all__)


def _layout() -> str:
    """Each package of ``fedray/`` and its modules, each with its docstring's first line (its one job)."""
    package = ROOT / "fedray"
    sections = []
    for folder in sorted({path.parent for path in package.rglob("*.py")}):
        name = folder.relative_to(ROOT).as_posix()
        rows = []
        for path in sorted(folder.glob("*.py")):
            summary = _docstring_line(path)
            if path.name in ("__init__.py", "__main__.py") and not summary:
                continue
            rows.append(f"| `{path.name}` | {_escaped(summary)} |")
        sections.append(f"**`{name}/`**\n\n| module | what it does |\n|---|---|\n" + "\n".join(rows) + "\n")
    return "\n".join(sections)


def _docstring_line(path: Path) -> str:
    """The module docstring's first sentence or line (joined across a line break inside the sentence)."""
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    paragraph = docstring.split("\n\n")[0]
    return " ".join(paragraph.split())
