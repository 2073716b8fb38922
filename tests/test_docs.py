"""The documentation runs as written: every code block of README.md and docs/*.md, (slow) the commands of
docs/accuracy.md, which must give the accuracy the page states, and docs/api.md lists every public name
with its signature as it is.

Code blocks are fenced with their language. `python` and `sh` blocks run, in page order, in one fresh
folder per page (a later block finds what an earlier one wrote: a run directory, a .jbnn file), with this
environment's `jaxbnn` and `python` first on PATH; consecutive `python` blocks run as one program, so the
steps of a page share their variables. `text` blocks (signatures, formulas, file layouts,
printed output) are not code. Two commands are checked rather than run, since this very environment was
made by them: `pip install` (the extras it names must exist) and `pytest`.
"""

import importlib
import inspect
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from jaxbnn import cli

REPOSITORY = Path(__file__).parents[1]
PAGES = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]
LANGUAGES = ("python", "sh", "text")


def code_blocks(page: Path) -> list[tuple[str, str, int]]:
    """(language, code, first line number) of every code block on a page; indented blocks have language ''."""
    tokens = MarkdownIt().parse(page.read_text())
    return [(t.info.split()[0] if t.info.strip() else "", t.content, t.map[0] + 1)
            for t in tokens if t.type in ("fence", "code_block")]


def where(page: Path, line: int) -> str:
    return f"{page.relative_to(REPOSITORY)}:{line}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_code_block_is_fenced_with_its_language(page):
    for language, _, line in code_blocks(page):
        assert language in LANGUAGES, f"{where(page, line)}: fence the block as one of {LANGUAGES}"


def checked_not_run(command: str) -> bool:
    """`pip install` and `pytest`: check a pip install's extras exist; True for both (do not run them)."""
    words = shlex.split(command)
    if words[:2] == ["pip", "install"]:
        extras = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for word in words[2:]:
            named = re.fullmatch(r"\.\[([\w,-]+)\]", word)
            if named:
                missing = set(named.group(1).split(",")) - set(extras)
                assert not missing, f"{command}: pyproject.toml has no extra {sorted(missing)}"
        return True
    return words[:1] == ["pytest"]


def shell_script(code: str) -> str:
    """The block's commands, without those this environment already ran (checked instead)."""
    lines = []
    for line in code.splitlines():
        command = line.split(" #")[0].strip()
        if command and not command.startswith("#"):
            lines.append(" && ".join(part for part in command.split(" && ") if not checked_not_run(part)))
    return "\n".join(line for line in lines if line)


def environment() -> dict:
    return {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}


def run_code(page: Path, language: str, code: str, line: int, folder: Path) -> None:
    if language == "python":
        script = folder.parent / f"{page.stem}-{line}.py"
        script.write_text(code)
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", shell_script(code)]
    result = subprocess.run(argv, cwd=folder, env=environment(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{where(page, line)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    for warning in ("NativeKernelsWarning", "InputRangeWarning"):
        assert warning not in result.stderr, f"{where(page, line)}: {result.stderr[-3000:]}"


def programs(page: Path) -> list[tuple[str, str, int]]:
    """The page's runnable code in order: each sh block, and each run of consecutive python blocks joined."""
    out = []
    for language, code, line in code_blocks(page):
        if language == "python" and out and out[-1][0] == "python":
            out[-1] = ("python", f"{out[-1][1]}\n# {where(page, line)}\n{code}", out[-1][2])
        elif language in ("python", "sh"):
            out.append((language, f"# {where(page, line)}\n{code}" if language == "python" else code, line))
    return out


RUNNABLE = [page for page in PAGES if programs(page)]


@pytest.mark.mnist5k
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name)
def test_the_code_of_a_page_runs_as_written(page, tmp_path):
    folder = tmp_path / "work"
    folder.mkdir()
    for language, code, line in programs(page):
        run_code(page, language, code, line, folder)


# --- docs/accuracy.md: each row's command gives the row's accuracy --------------------------------------------


def accuracy_rows() -> list[dict]:
    """The table of docs/accuracy.md as dicts keyed by its header."""
    lines = [line for line in (REPOSITORY / "docs" / "accuracy.md").read_text().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


@pytest.mark.slow
@pytest.mark.mnist5k
@pytest.mark.parametrize("row", accuracy_rows(), ids=lambda row: f"{row['model'].split()[0]}-{row['mode']}")
def test_each_accuracy_row_is_what_its_command_gives(row, tmp_path):
    import jax

    column = "test accuracy (CPU)" if jax.default_backend() == "cpu" else "test accuracy (GPU)"
    if not row[column].endswith("%"):
        pytest.skip(f"the page records no accuracy for this backend ({column}: {row[column]})")
    command = row["command"].strip("`")
    result = subprocess.run(shlex.split(command), cwd=tmp_path, env=environment(), capture_output=True, text=True,
                            timeout=3600)
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = float(re.search(r"final test accuracy ([0-9.]+) after epoch (\d+)", result.stdout).group(1))
    assert f"{100 * accuracy:.1f}%" == row[column], (command, accuracy)


# --- docs/api.md: every public name, with its signature as it is ---------------------------------------------

API_PAGE = REPOSITORY / "docs" / "api.md"
# the sections of the page: module -> how to import it (export and train ship inside jaxbnn in a wheel)
API_MODULES = {
    "jaxbnn": lambda: importlib.import_module("jaxbnn"),
    "jaxbnn.ops": lambda: importlib.import_module("jaxbnn.ops"),
    "jaxbnn.runtime": lambda: importlib.import_module("jaxbnn.runtime"),
    "jaxbnn.formats": lambda: importlib.import_module("jaxbnn.formats"),
    "jaxbnn.models": lambda: importlib.import_module("jaxbnn.models"),
    "jaxbnn.packed_model": lambda: importlib.import_module("jaxbnn.packed_model"),
    "jaxbnn.bench": lambda: importlib.import_module("jaxbnn.bench"),
    "jaxbnn.export": lambda: cli.import_export_package(),
    "jaxbnn.train.loop": lambda: cli.import_train_module("loop"),
    "jaxbnn.train.data": lambda: cli.import_train_module("data"),
}
OWN_PACKAGES = ("jaxbnn", "export", "train")


class _Shown:
    """A default value as the page writes it (a type or a function by its dotted name, not its repr)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _shown_default(value):
    if value is not inspect.Parameter.empty and (isinstance(value, type) or inspect.isroutine(value)):
        module = "" if value.__module__ == "builtins" else f"{value.__module__}."
        return _Shown(module + value.__qualname__)
    return value


def documented_signature(obj) -> str | None:
    """The signature docs/api.md shows for a public object: the parameters and defaults (no annotations)
    of a function or class of jaxbnn's own (a class's without self), or None (modules, constants, aliases
    of other libraries' objects, exceptions and warnings)."""
    if not callable(obj) or not str(getattr(obj, "__module__", "")).startswith(OWN_PACKAGES) or (
            isinstance(obj, type) and issubclass(obj, BaseException)):
        return None
    signature = inspect.signature(obj)
    parameters = list(signature.parameters.values())
    if isinstance(obj, type) and [p.kind for p in parameters] == [inspect.Parameter.VAR_POSITIONAL,
                                                                  inspect.Parameter.VAR_KEYWORD]:
        parameters = list(inspect.signature(obj.__init__).parameters.values())  # an NNX module's metaclass
    if parameters and parameters[0].name == "self":
        parameters = parameters[1:]
    parameters = [p.replace(annotation=inspect.Parameter.empty, default=_shown_default(p.default))
                  for p in parameters]
    return str(signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty))


def api_entries() -> dict[str, dict[str, str]]:
    """Section (module) -> documented name -> the code span of its entry (`name(signature)`), from the
    page's `## \\`module\\`` headings and `- \\`...\\`: summary` items."""
    sections, current = {}, None
    for line in API_PAGE.read_text().splitlines():
        heading = re.fullmatch(r"## `([\w.]+)`", line)
        if heading:
            current = sections.setdefault(heading.group(1), {})
        item = re.match(r"- `([^`]+)`: \S", line)
        if item and current is not None:
            span = item.group(1)
            current[span.split("(")[0]] = span
    return sections


def resolve(module, dotted: str):
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("section", API_MODULES)
def test_the_api_page_lists_every_public_name_with_its_signature(section):
    module = API_MODULES[section]()
    entries = api_entries().get(section)
    assert entries is not None, f"docs/api.md has no section ## `{section}`"
    missing = [name for name in module.__all__ if name not in entries]
    assert not missing, f"docs/api.md, {section}: public names not documented: {missing}"
    unexported = [name for name in entries if "." not in name and name not in module.__all__]
    assert not unexported, f"docs/api.md, {section}: documented names missing from __all__: {unexported}"
    for name, span in entries.items():
        try:
            obj = resolve(module, name)
        except AttributeError:
            pytest.fail(f"docs/api.md, {section}: documents {name}, which {section} no longer has")
        signature = documented_signature(obj)
        expected = name + (signature or "")
        assert span == expected, f"docs/api.md, {section}: `{span}` should read `{expected}`"
