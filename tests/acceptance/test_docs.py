"""The docs cannot silently rot: their runnable examples run, and their pages and links exist.

Convention for runnable examples (docs/tutorial.md and docs/howto/*.md):

- A fenced block whose opening fence (```python or ```sh) comes right after a line
  ``<!-- test -->`` is runnable. All runnable blocks of one page run in document order, in one
  Python process (Python blocks share their globals, as a reader following the page would),
  against a fresh SQLite store: ``LATCHKEY_URL=sqlite:///<tmp>/locks.db``, the working
  directory a fresh temporary directory. ``sh`` blocks run with ``bash -e`` from that process,
  with the venv's ``latchkey`` first on PATH.
- An HTML comment ``<!-- test-setup … -->`` holds Python that runs before the page's blocks
  and is not shown on the site: stand-ins for the reader's own functions (``process(row)``).
- Other blocks (output, cron lines, SQL, code for a server store) are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

RUNNABLE = re.compile(r"^<!-- test -->\n```(python|sh)\n(.*?)^```$", re.M | re.S)
MARKER = re.compile(r"^<!-- test -->$", re.M)
SETUP = re.compile(r"^<!-- test-setup\n(.*?)^-->$", re.M | re.S)
NAV_PAGE = re.compile(r"^\s*- (?:[^:\n]+: )?(\S+\.md)\s*$", re.M)
LINK = re.compile(r"\]\(([^)\s]+?)\)")

#: The pages this docs site's writer owns (the rest of the nav is written by others).
OWN_PAGES = [
    "index.md",
    "tutorial.md",
    "howto/memcached-batch-job.md",
    "howto/digest-mailer.md",
    "howto/event-queue-daemons.md",
    "howto/scheduled-task-and-json-merge.md",
    "howto/deploy-migrations.md",
    "howto/asyncio.md",
    "howto/production.md",
    "concepts/architecture.md",
    "concepts/leases-and-fencing.md",
    "concepts/waiting.md",
    "concepts/guarantees.md",
    "stores/sqlite.md",
    "stores/memory.md",
    "reference/api.md",
    "reference/cli.md",
    "reference/urls.md",
]

#: Nav pages still being written elsewhere: allowed to be missing for now. Empty this set to
#: require every page of the nav (and every link to one).
PENDING: set[str] = set()


def nav_pages() -> list[str]:
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    return NAV_PAGE.findall(text.split("\nnav:\n", 1)[1])


def example_pages() -> list[Path]:
    return [DOCS / "tutorial.md", *sorted((DOCS / "howto").glob("*.md"))]


def script_for(page: Path) -> str:
    """The page's setup and runnable blocks as one Python program."""
    text = page.read_text(encoding="utf-8")
    blocks = RUNNABLE.findall(text)
    assert len(blocks) == len(MARKER.findall(text)), (
        f"{page.name}: a <!-- test --> marker is not directly followed by ```python or ```sh"
    )
    parts = ["import subprocess as _subprocess"]
    parts += [setup for setup in SETUP.findall(text)]
    for lineno, (language, code) in enumerate(blocks):
        if language == "python":
            parts.append(f"# --- block {lineno + 1}\n{code}")
        else:
            parts.append(
                f"# --- block {lineno + 1} (sh)\n"
                f"_subprocess.run(['bash', '-ec', {code!r}], check=True)"
            )
    return "\n".join(parts)


@pytest.mark.parametrize("page", example_pages(), ids=lambda p: p.name)
def test_runnable_examples(page: Path, tmp_path: Path) -> None:
    script = script_for(page)
    if "# --- block" not in script:
        pytest.skip(f"{page.name} has no runnable examples")
    run_examples(script, tmp_path, f"sqlite:///{tmp_path}/locks.db", page.name)


def run_examples(
    script: str, tmp_path: Path, url: str, label: str
) -> subprocess.CompletedProcess[str]:
    """Run a page's examples (:func:`script_for`) as one program in a fresh directory, with
    ``LATCHKEY_URL`` set to ``url`` and every warning an error; fail with its output, else
    return the finished process."""
    program = tmp_path / "example.py"
    program.write_text(script, encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        "LATCHKEY_URL": url,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONWARNINGS": "error",
    }
    result = subprocess.run(
        [sys.executable, str(program)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, (
        f"{label}: an example failed\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )
    return result


def test_own_pages_exist_and_are_in_the_nav() -> None:
    nav = nav_pages()
    missing = [page for page in OWN_PAGES if not (DOCS / page).is_file()]
    assert not missing, f"pages not written: {missing}"
    absent = [page for page in OWN_PAGES if page not in nav]
    assert not absent, f"pages not in mkdocs.yml nav: {absent}"


def test_nav_lists_each_page_once() -> None:
    nav = nav_pages()
    assert len(nav) == len(set(nav))
    assert set(OWN_PAGES) | PENDING <= set(nav)


@pytest.mark.parametrize("page", nav_pages())
def test_nav_page_exists(page: str) -> None:
    if page in PENDING and not (DOCS / page).exists():
        pytest.skip(f"{page} is still being written")
    assert (DOCS / page).is_file(), f"mkdocs.yml lists {page}, which does not exist"


@pytest.mark.parametrize("page", OWN_PAGES)
def test_relative_links_resolve(page: str) -> None:
    source = DOCS / page
    broken = []
    for target in LINK.findall(source.read_text(encoding="utf-8")):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        path = target.split("#", 1)[0]
        resolved = (source.parent / path).resolve()
        if not resolved.is_relative_to(DOCS.resolve()):
            broken.append(target)  # mkdocs cannot link outside docs/
            continue
        pending = resolved.relative_to(DOCS.resolve()).as_posix() in PENDING
        if not resolved.exists() and not pending:
            broken.append(target)
    assert not broken, f"{page}: links to missing pages: {broken}"
