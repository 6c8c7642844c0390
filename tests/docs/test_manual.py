"""Every shell and Python block of README.md and the manual (docs/) runs as written, or says why it cannot.

A fenced block is read by its language:

- ``bash``: each command runs in-process, in one folder per test session that the pages share in the manual's
  order (a page may use the files an earlier page wrote): ``fedray ARGS`` (or ``.venv/bin/fedray``) through the
  command line's ``main``, ``python -m MODULE ARGS`` (or ``.venv/bin/python``) as that module's ``__main__``; each must
  succeed. A command an earlier page ran word for word runs once. Any other command is a defect of the page, unless
  the block is marked.
- ``python``: executed in one namespace per page; a block whose first line is ``# NAME.py`` is a file, written to
  the folder as NAME.py (a plugin, a dataset function) and not executed.
- ``yaml``: a block whose first line is ``# PATH`` is written to the folder as PATH; others are not run.
- anything else (``text``: output, tables) is not run.

An HTML comment on the line right before a block marks it: ``<!-- not run: REASON -->`` (a GPU, a real cluster,
real images or weights, a set-up command: REASON says which) is never run.
"""

from __future__ import annotations

import glob
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from fedray.app.cli import main

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(?P<language>[\w-]*)\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)
MARK = re.compile(r"<!-- (?P<kind>not run): (?P<why>[^>]*\S) -->\n\Z")
LINKED_FOLDERS = ("examples", "jobs", "presets", "analysis")
"""The repository's folders a page's commands name by relative path (``examples/fedyogi.py:FedYogi``)."""


def manual_pages() -> list[Path]:
    """README.md, then the manual's pages in its navigation order (mkdocs.yml's ``nav``)."""
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    return [REPO / "README.md", *(REPO / "docs" / next(iter(entry.values())) for entry in nav)]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    code: str
    mark: tuple[str, str] | None
    """("not run", why): the comment right before the block."""

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    found = []
    for fence in FENCE.finditer(text):
        mark = MARK.search(text, 0, fence.start())
        found.append(Block(page, text.count("\n", 0, fence.start()) + 1, fence["language"], fence["code"],
                           (mark["kind"], mark["why"]) if mark else None))
    return found


def commands(code: str) -> list[list[str]]:
    """A shell block's commands, each as its words: continued lines joined, comments dropped."""
    joined = code.replace("\\\n", " ")
    return [words for words in (shlex.split(line, comments=True) for line in joined.splitlines()) if words]


def runnable(words: list[str]) -> tuple[str, list[str]] | None:
    """("fedray", ARGS) or ("module", [MODULE, *ARGS]) for a command a page may run, else None."""
    program = words[0].removeprefix(".venv/bin/")
    if program == "fedray":
        return "fedray", words[1:]
    if program in ("python", "python3") and len(words) > 2 and words[1] == "-m":
        return "module", words[2:]
    return None


def test_the_readme_is_short():
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def test_every_block_runs_or_says_why_not():
    """Each shell block's commands are ones the test runs, unless the block is marked ``not run`` with a reason."""
    for block in (block for page in manual_pages() for block in blocks(page)):
        if block.language == "bash" and not block.mark:
            strangers = [" ".join(words) for words in commands(block.code) if runnable(words) is None]
            assert not strangers, f"{block}: cannot run {strangers}; mark the block <!-- not run: REASON -->"


def test_the_manual_s_generated_parts_are_made_from_fedray_s_own_listings():
    """The hook renders ``fedray methods``, ``fedray run --help``'s groups, the API and the layout (mkdocs build runs
    them too; here they are checked for what they must hold)."""
    sys.path.insert(0, str(REPO / "docs"))
    try:
        import hooks
    finally:
        sys.path.remove(str(REPO / "docs"))
    methods = hooks.on_page_markdown("<!-- fedray:methods -->", None, None, None)
    assert methods.startswith("```text\n") and "fed3r" in methods and "lam" in methods
    options = hooks.on_page_markdown("<!-- fedray:options run -->", None, None, None)
    assert "| `--method` |" in options and "| `--lam` |" in options and "### client sampling" in options
    api = hooks.on_page_markdown("<!-- fedray:api -->", None, None, None)
    assert "::: fedray.methods.base.ClosedFormMethod" in api and "## `fedray.run`" in api
    layout = hooks.on_page_markdown("<!-- fedray:layout -->", None, None, None)
    assert "**`fedray/engine/`**" in layout and "| `round_loop.py` |" in layout


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The folder every page's commands run in, in order; the repository's example folders linked into it."""
    path = tmp_path_factory.mktemp("manual")
    for name in LINKED_FOLDERS:
        (path / name).symlink_to(REPO / name)
    return path


def _run_fedray(block: Block, args: list[str]) -> None:
    try:
        code = main(args)
    except SystemExit as stop:  # --help
        code = stop.code
    assert code in (0, None), f"{block}: fedray {' '.join(args)} exited with {code}"


def _run_module(args: list[str]) -> None:
    module, *rest = args
    argv = sys.argv
    sys.argv = [module, *rest]
    imported = sys.modules.pop(module, None)  # `python -m` runs a fresh copy as __main__, not one imported earlier
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        assert stop.code in (0, None), f"python -m {' '.join(args)} exited with {stop.code}"
    finally:
        sys.argv = argv
        if imported is not None:
            sys.modules[module] = imported


def _run_block(block: Block, folder: Path, namespace: dict, done: set[tuple[str, ...]]) -> None:
    first_line = block.code.split("\n", 1)[0]
    if block.language in ("python", "yaml") and re.fullmatch(r"# [\w./-]+\.(py|yaml)", first_line):
        target = folder / first_line[2:]
        assert folder in target.resolve().parents, f"{block}: {first_line[2:]} lies outside the page's folder"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.code, encoding="utf-8")
    elif block.language == "python":
        exec(compile(block.code, str(block), "exec"), namespace)
    elif block.language == "bash":
        for words in commands(block.code):
            if tuple(words) in done:  # an earlier block ran this very command: once proves it
                continue
            done.add(tuple(words))
            kind, args = runnable(words)
            args = [match for word in args for match in (sorted(glob.glob(word)) if "*" in word else [word])]
            if kind == "fedray":
                _run_fedray(block, args)
            else:
                _run_module(args)


@pytest.fixture(scope="module")
def commands_run() -> set[tuple[str, ...]]:
    """The commands the pages have run so far (the README's and the manual's share some)."""
    return set()


@pytest.mark.slow
@pytest.mark.parametrize("page", manual_pages(), ids=lambda page: page.name)
def test_the_page_s_blocks_run(page, folder, commands_run, ray_session, monkeypatch):
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    namespace: dict = {"__name__": "__manual__"}
    for block in blocks(page):
        if block.mark:
            continue
        _run_block(block, folder, namespace, commands_run)
