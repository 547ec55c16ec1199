"""The documentation: the site builds with `mkdocs build --strict` (no broken links or anchors, no page
outside the nav), the README's links resolve, headline numbers appear in the pages they cite, and the
code blocks of README.md and docs/guide/*.md run as written.

Each `bash` / `python` block of those pages follows a marker comment (docs/guide/tests.md has the table):
  <!-- test: setup -->           run first, once; every other block starts in a copy of what it made
  <!-- test: run -->             run as written in a fresh directory (python: the interpreter; bash: bash -e)
  <!-- test: run slow: WHY -->   the same, with the `slow` marker (pytest -m slow) where the README runs its path
  <!-- test: file NAME -->       saved as NAME for the run blocks after it on the same page
  <!-- test: server -->          started in the background; the `client` blocks after it run against it
  <!-- test: client [needs=M] --> run while the server is up (skipped where module M is not installed)
  <!-- test: parse: REASON -->   not run (a download, a GPU, minutes); its commands must parse
Every block's `thunderep` commands are parsed with the real command line first, so a flag that does not
exist fails here before anything runs. Port 8000 in server and client blocks becomes a free port.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
KINDS = ("setup", "run", "file", "server", "client", "parse")
CODE = ("bash", "python")
BLOCK_TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    kind: str | None
    arg: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of `page`, each with the marker comment on the line before its fence."""
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})(.*)$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1)))
        marker = re.match(r"^<!--\s*test:\s*(\w+)\s*(.*?)\s*-->$", lines[i - 1].strip()) if i else None
        kind, arg = (marker.group(1), marker.group(2).lstrip(":").strip()) if marker else (None, "")
        found.append(Block(page, i + 1, fence.group(2).strip(), kind, arg, "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
CODE_BLOCKS = [b for b in ALL if b.lang in CODE]


def _ids(items):
    return [b.where for b in items]


# ---- every block is marked, and its commands parse ----

def test_every_code_block_says_how_it_is_tested():
    problems = [f"{b.where}: a fence needs a language (text for output)" for b in ALL if not b.lang]
    problems += [f"{b.where}: a {b.lang} block needs a marker before it, one of <!-- test: {' | '.join(KINDS)} -->"
                 for b in CODE_BLOCKS if b.kind not in KINDS]
    problems += [f"{b.where}: `parse` needs a reason: <!-- test: parse: why it does not run -->"
                 for b in CODE_BLOCKS if b.kind == "parse" and not b.arg]
    problems += [f"{b.where}: `{b.kind}` blocks must be python" for b in CODE_BLOCKS if b.kind == "file" and b.lang != "python"]
    problems += [f"{b.where}: `server` blocks must be bash" for b in CODE_BLOCKS if b.kind == "server" and b.lang != "bash"]
    assert not problems, "\n".join(problems)
    assert sum(b.kind == "setup" for b in CODE_BLOCKS) == 1, "exactly one setup block (the README's tiny model)"


class _Parsed(BaseException):
    """Raised once the command line has parsed: nothing after the parse runs."""


def _parse_with(main, argv: list[str], what: str) -> None:
    """Run `main(argv)` until its argparse parser has parsed `argv`; fail if it refuses it."""
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    err = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_and_stop), \
            contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except _Parsed:
            return
        except SystemExit as exc:
            if exc.code in (0, None):  # --help
                return
            raise AssertionError(f"`{what}` does not parse:\n{err.getvalue()}") from None
    raise AssertionError(f"`{what}` returned without parsing its arguments")


def commands(script: str) -> list[list[str]]:
    """The simple commands of a bash script: words split as the shell does, operators and redirections
    dropped, leading VAR=value assignments and sudo removed."""
    script = script.replace("\\\n", " ")
    found = []
    for line in script.split("\n"):
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split, lex.commenters = True, "#"
        words, skip_next = [], False
        for token in [*lex, ";"]:
            if skip_next:
                skip_next = False
            elif token in (">", ">>", "<", "2>", "&>"):
                skip_next = True
            elif token and set(token) <= set(";&|()"):
                while words and (re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]) or words[0] == "sudo"):
                    words.pop(0)
                if words:
                    found.append(words)
                words = []
            else:
                words.append(token)
    return found


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def check_command(words: list[str], page_files: set[str]) -> None:
    """Fail if `words` (one command of a documented block) would not start as documented."""
    from thunderep import cli

    text = " ".join(words)
    if words[0] == "thunderep":
        _parse_with(cli.main, words[1:], text)
    elif words[:3] in (["python", "-m", "thunderep.cli"], ["python3", "-m", "thunderep.cli"]):
        _parse_with(cli.main, words[3:], text)
    elif words[0] == "sysconfig/thunderep-sysconfig":
        from thunderep.cli import sysconfig

        _parse_with(sysconfig.main, words[1:], text)
    elif words[0] == "make":
        missing = [t for t in words[1:] if "=" not in t and t not in _make_targets()]
        assert not missing, f"`{text}`: no such Makefile target {missing}"
    elif words[0] == "torchrun":
        script = next((w for w in words[1:] if w.endswith(".py")), None)
        assert script is not None, f"`{text}`: no script"
        assert script in page_files or (ROOT / script).is_file(), \
            f"`{text}`: {script} is neither a `file` block of the page nor a file of the repository"


def _page_files(block: Block) -> set[str]:
    return {b.arg for b in CODE_BLOCKS if b.page == block.page and b.kind == "file"}


@pytest.mark.parametrize("block", CODE_BLOCKS, ids=_ids(CODE_BLOCKS))
def test_block_parses(block):
    if block.lang == "python":
        compile(block.text, block.where, "exec")
        return
    for words in commands(block.text):
        check_command(words, _page_files(block))


def test_a_flag_that_does_not_exist_fails_the_parse():
    check_command(["thunderep", "generate", "--model", "m", "--ep", "2", "--prompt", "hi"], set())
    with pytest.raises(AssertionError, match="does not parse"):
        check_command(["thunderep", "generate", "--model", "m", "--no-such-flag"], set())
    with pytest.raises(AssertionError, match="no such Makefile target"):
        check_command(["make", "no-such-target"], set())
    assert commands("A=1 thunderep plan --model m > out.txt && curl x | grep y  # note\n") == \
        [["thunderep", "plan", "--model", "m"], ["curl", "x"], ["grep", "y"]]


# ---- running the blocks ----

def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _command(block: Block) -> list[str]:
    return [sys.executable, "-c", block.text] if block.lang == "python" else ["bash", "-e", "-o", "pipefail", "-c", block.text]


def _run(block: Block, cwd: Path, text: str | None = None) -> str:
    if text is not None:
        block = Block(block.page, block.line, block.lang, block.kind, block.arg, text)
    try:
        done = subprocess.run(_command(block), check=False, cwd=cwd, env=_env(), capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{block.where} ran past {BLOCK_TIMEOUT_S} s:\n{exc.stdout}\n{exc.stderr}") from None
    assert done.returncode == 0, f"{block.where} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="session")
def setup_dir(tmp_path_factory) -> Path:
    """What the README's setup block (the tiny model) makes."""
    (block,) = [b for b in CODE_BLOCKS if b.kind == "setup"]
    directory = tmp_path_factory.mktemp("setup")
    _run(block, directory)
    return directory


def _workdir(block: Block, setup_dir: Path, tmp_path: Path) -> Path:
    work = tmp_path / "work"
    shutil.copytree(setup_dir, work)
    for b in CODE_BLOCKS:
        if b.page == block.page and b.kind == "file" and b.line < block.line:
            (work / b.arg).write_text(b.text)
    return work


RUN_BLOCKS = [pytest.param(b, id=b.where, marks=[pytest.mark.slow] if b.arg.startswith("slow") else [])
              for b in CODE_BLOCKS if b.kind == "run"]


@pytest.mark.parametrize("block", RUN_BLOCKS)
def test_block_runs(block, setup_dir, tmp_path):
    _run(block, _workdir(block, setup_dir, tmp_path))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(server: subprocess.Popen, port: int, block: Block, timeout_s: float = BLOCK_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"{block.where}: the server exited with {server.returncode}:\n"
                                 f"{server.stdout.read()}")
        with contextlib.suppress(OSError), \
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
            if answer.status == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"{block.where}: /health did not answer 200 within {timeout_s} s")


SERVER_BLOCKS = [b for b in CODE_BLOCKS if b.kind == "server"]


def _clients(server: Block) -> list[Block]:
    """The client blocks after `server` on its page, up to the next server block."""
    later = [b for b in CODE_BLOCKS if b.page == server.page and b.line > server.line]
    return [b for b in later[:next((i for i, b in enumerate(later) if b.kind == "server"), len(later))]
            if b.kind == "client"]


@pytest.mark.parametrize("block", SERVER_BLOCKS, ids=_ids(SERVER_BLOCKS))
def test_server_answers_its_clients(block, setup_dir, tmp_path):
    work, port = _workdir(block, setup_dir, tmp_path), _free_port()
    clients = _clients(block)
    assert clients, f"{block.where}: a server block without client blocks after it"
    server = subprocess.Popen(["bash", "-c", block.text.replace("8000", str(port))], cwd=work, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_healthy(server, port, block)
        for client in clients:
            needs = re.match(r"needs=([\w.]+)", client.arg)
            if needs and importlib.util.find_spec(needs.group(1)) is None:
                warnings.warn(f"{client.where} not run: {needs.group(1)} is not installed")
                continue
            _run(client, work, client.text.replace("8000", str(port)))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


# ---- the site, the README's links, the numbers ----

def test_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (the docs or dev extra)")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr}"


def _github_slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {_github_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if re.match(r"^[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else ROOT / "README.md"
        if not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            problems.append(f"{target}: no heading with anchor #{anchor}")
    assert not problems, "\n".join(problems)


def _table_rows_with_links(page: Path):
    for line in page.read_text().split("\n"):
        if line.startswith("|") and "](" in line:
            yield line


@pytest.mark.parametrize("page", ["README.md", "docs/benchmarks/README.md"])
def test_headline_numbers_appear_in_their_sources(page):
    """Every decimal number and ratio of a headline row is in the campaign file the row links to."""
    path = ROOT / page
    problems = []
    for row in _table_rows_with_links(path):
        result = row.split("|")[1]
        sources = [path.parent / t for t in re.findall(r"\]\(([^)#]+\.md)\)", row)]
        text = " ".join(s.read_text() for s in sources if s.exists())
        for number in re.findall(r"\d+\.\d+x?|\d+x", result):
            if number not in text:
                problems.append(f"{page}: {number} of `{result.strip()[:60]}` is not in {[s.name for s in sources]}")
    assert not problems, "\n".join(problems)
