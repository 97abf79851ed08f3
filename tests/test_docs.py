"""The documentation tells the truth about the code: every config key has a description, the
generated reference pages are current, and the examples marked runnable run as shown.

A runnable example is a fenced block of class `runnable` in a page under docs/:

    ``` {.console .runnable}
    $ reservoir sql "SELECT 1; SELECT 2"
    error: SQL failed: cannot insert multiple commands into a prepared statement; nothing ...
    ```

Each page's runnable blocks run in order against one fresh database at the schema's head, in an
empty folder holding the page's files (its code blocks with a `title="NAME"`, indented ones
inside an admonition too). A `$ ` line is a `reservoir` command, after optional `NAME=value`
settings of its environment (continued on the next lines while a quote is open; `# ...` is a
comment). The lines up to the next `$ ` are its output (stdout and stderr, 80 columns wide), as
printed but for trailing spaces, where `...` in a line stands for any text and a line of `...`
alone for any number of lines. An output with an `error:` line expects exit code 1, any other 0. Python blocks of class `runnable`
run with RESERVOIR_DB_URL set to a fresh database.

DOCS_SHOW=1 prints what each command printed (to paste into a page) and checks nothing.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import reservoir.config as config_module
from pydantic import BaseModel
from reservoir.config import ReservoirConfig

from tests.commands import RESERVOIR, command_env

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SHOW = bool(os.environ.get("DOCS_SHOW"))
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,})[ \t]*(?P<info>[^\n]*)\n(?P<body>.*?)"
                   r"^(?P=indent)(?P=fence)[ \t]*$", re.MULTILINE | re.DOTALL)


# --- (a) every config key is described ------------------------------------------------------

def models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models a field's type holds (through Annotated, unions and tuples)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        args = args[:1]
    return [model for arg in args if arg is not Ellipsis for model in models_in(arg)]


def reachable_models(root: type[BaseModel]) -> list[type[BaseModel]]:
    found, queue = [], [root]
    while queue:
        model = queue.pop()
        if model in found:
            continue
        found.append(model)
        for field in model.model_fields.values():
            queue += models_in(field.annotation)
    return found


def undescribed(root: type[BaseModel]) -> list[str]:
    return [f"{model.__name__}.{name}" for model in reachable_models(root)
            for name, field in model.model_fields.items()
            if not (field.description or "").strip()]


def test_every_config_key_has_a_description():
    assert undescribed(ReservoirConfig) == []


def test_every_config_model_is_reached_from_the_top():
    defined = {obj for obj in vars(config_module).values() if isinstance(obj, type)
               and issubclass(obj, BaseModel) and obj.__module__ == config_module.__name__
               and obj.model_fields}
    assert defined <= set(reachable_models(ReservoirConfig))


def test_a_key_without_a_description_is_found():
    from pydantic import Field, create_model

    inner = create_model("Inner", described=(int, Field(0, description="has one")), bare=(int, 0))
    outer = create_model("Outer", section=(inner | None, None),
                         many=(tuple[inner, ...], ()))
    assert undescribed(outer) == ["Outer.section", "Outer.many", "Inner.bare"]


# --- (b) the generated reference is current -------------------------------------------------

def test_generated_reference_pages_are_current(tmp_path):
    from tools import reference

    assert reference.main(["--out", str(tmp_path)]) == 0
    for name in ("cli.md", "config.md"):
        committed = DOCS / "reference" / name
        assert committed.exists(), f"{committed} is missing: run python tools/reference.py"
        assert (tmp_path / name).read_text() == committed.read_text(), \
            f"docs/reference/{name} is stale: run python tools/reference.py"


# --- (c) runnable examples run as shown -----------------------------------------------------

@dataclass
class Block:
    page: Path
    info: str
    body: str

    @property
    def classes(self) -> list[str]:
        inside = re.match(r"\{(.*)\}", self.info.strip())
        words = inside.group(1).split() if inside else self.info.split()[:1]
        return [word.lstrip(".") for word in words if not word.startswith(("#", "title"))]

    @property
    def title(self) -> str | None:
        found = re.search(r'title="([^"]+)"', self.info)
        return found.group(1) if found else None


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, those inside an admonition or a list (indented) included."""
    return [Block(page, m["info"], re.sub(f"(?m)^{m['indent']}", "", m["body"]))
            for m in FENCE.finditer(page.read_text())]


def runnable(page: Path, kind: str) -> list[Block]:
    return [b for b in blocks(page) if "runnable" in b.classes and kind in b.classes]


PAGES = sorted(DOCS.rglob("*.md"))
CONSOLE_PAGES = [page for page in PAGES if runnable(page, "console")]
PYTHON_BLOCKS = [block for page in PAGES for block in runnable(page, "python")]


@dataclass
class Example:
    command: str
    expected: list[str]


def examples(body: str) -> list[Example]:
    """The `$ ` commands of a console block, each with the output lines shown after it."""
    found: list[Example] = []
    lines = body.rstrip("\n").split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("$ "):
            assert found, f"output before any command: {line!r}"
            found[-1].expected.append(line)
            i += 1
            continue
        command = line[2:]
        while not complete(command):
            i += 1
            command += "\n" + lines[i]
        found.append(Example(command, []))
        i += 1
    return found


def complete(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:
        return False
    return True


def line_pattern(line: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in line.rstrip().split("...")))


def matches(expected: list[str], actual: list[str]) -> bool:
    """Each expected line matches an actual line in order; a '...' line skips any lines; without
    one, the lines must follow each other from the first."""
    def match(e: int, a: int) -> bool:
        if e == len(expected):
            return a == len(actual)
        if expected[e].strip() == "...":
            return any(match(e + 1, k) for k in range(a, len(actual) + 1))
        return a < len(actual) and bool(line_pattern(expected[e]).fullmatch(actual[a].rstrip())) \
            and match(e + 1, a + 1)
    return match(0, 0)


def run_example(example: Example, url: str, cwd: Path) -> subprocess.CompletedProcess:
    words = shlex.split(example.command, comments=True)
    env = {**command_env(url), "COLUMNS": "80", "NO_COLOR": "1"}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    assert words[0] == "reservoir", f"a runnable example runs reservoir, not {words[0]!r}"
    return subprocess.run([str(RESERVOIR), *words[1:]], check=False, env=env, cwd=cwd, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)


@pytest.mark.slow  # a page's commands take 1 to 6 s together
@pytest.mark.process
@pytest.mark.parametrize("page", CONSOLE_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_console_examples_run_as_shown(page, db_url, tmp_path):
    for block in blocks(page):
        if block.title:
            (tmp_path / block.title).write_text(block.body)
    for block in runnable(page, "console"):
        for example in examples(block.body):
            result = run_example(example, db_url, tmp_path)
            actual = result.stdout.rstrip("\n").split("\n") if result.stdout.strip() else []
            expected = list(example.expected)
            while expected and not expected[-1].strip():
                expected.pop()
            if SHOW:
                print(f"\n$ {example.command}  [exit {result.returncode}]\n{result.stdout}")
                continue
            failing = any(line.startswith("error:") for line in expected)
            where = f"{page.relative_to(ROOT)}: $ {example.command}"
            assert result.returncode == (1 if failing else 0), f"{where}\n{result.stdout}"
            assert matches(expected, actual), \
                f"{where}\nshown:\n" + "\n".join(expected) + "\nprinted:\n" + result.stdout


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: str(b.page.relative_to(DOCS)))
def test_python_examples_run(block, db_url, monkeypatch):
    monkeypatch.setenv("RESERVOIR_DB_URL", db_url)
    code = block.body.replace("    ...", "    assert len(lease.rows) == 4")
    exec(compile(code, str(block.page), "exec"), {"__name__": "docs_example"})  # noqa: S102


def test_the_docs_hold_runnable_examples():
    assert CONSOLE_PAGES and PYTHON_BLOCKS


def test_the_harness_reads_commands_and_outputs():
    found = examples('$ reservoir sql "SELECT\n   1"   # a comment\nline\n...\n$ reservoir x\n')
    assert [(e.command, e.expected) for e in found] == [
        ('reservoir sql "SELECT\n   1"   # a comment', ["line", "..."]), ("reservoir x", [])]
    assert matches(["a ... c", "...", "z"], ["a b c", "x", "y", "z"])
    assert not matches(["a", "z"], ["a", "b", "z"])
    assert not matches(["a"], ["b"])


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [str(p.relative_to(DOCS)) for p in PAGES if str(p.relative_to(DOCS)) not in nav]
    assert missing == []

