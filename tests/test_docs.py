"""The documentation runs as written: every code block of README.md and docs/*.md, and (slow) the
commands of docs/accuracy.md, which must give the accuracy the page states.

Code blocks are fenced with their language. `python` and `sh` blocks run, in page order, in one fresh
folder per page (a later block finds what an earlier one wrote: a run directory, a .jbnn file), with this
environment's `jaxbnn` and `python` first on PATH; consecutive `python` blocks run as one program, so the
steps of a page share their variables. `text` blocks (signatures, formulas, file layouts,
printed output) are not code. Two commands are checked rather than run, since this very environment was
made by them: `pip install` (the extras it names must exist) and `pytest`.
"""

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

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
