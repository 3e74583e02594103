"""How `python -m tests.doc_commands` runs the docs' commands: the scratch clone, a page's shell, its servers.

The scratch folder (/tmp/vdc-*, short: Ray's socket paths must fit 107 bytes) holds `base/` (the clone of HEAD,
installed), `sample/` (base plus `make export`), one copy per page under `pages/`, and each command's output
under `logs/`. It is removed at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.doc_commands import (
    PLACEHOLDERS,
    PREREQUISITES,
    ROOT,
    Command,
    classify,
    coverage_problems,
    parse_docs,
    server_of,
    users,
)

MARKER = "DOC_COMMANDS_RUN"  # in the environment of every process a page starts: how the sweep finds them
SETUP = "(setup)"
README = "README.md"  # starts from the bare clone: its `make demo` builds the sample itself
SAMPLE_SETUP = "make export"  # where every other page starts: the sample trained and exported, as README leaves it
# what a block's command line becomes: the block's shell state in, the state (exports, activate) out
STATEFUL = 'source "$DOC_STATE"\n{command}\n__doc_rc=$?; export -p > "$DOC_STATE"; exit $__doc_rc\n'


@dataclass
class Row:
    file: str
    command: str
    result: str

    @property
    def failed(self) -> bool:
        return self.result.startswith("failed")


def tail(log: Path, n: int = 3) -> str:
    """The last `n` non-empty lines of a log, on one line."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", log.read_text(errors="replace")) if log.exists() else ""
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return " / ".join(lines[-n:])[-400:]


def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `condition` until it holds (True) or `timeout_s` has passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not (held := condition()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return held


# how a reader stops a server (Ctrl-C sends SIGINT to the terminal's foreground group), then firmer
CTRL_C = ((signal.SIGINT, 30.0), (signal.SIGTERM, 30.0))


def kill_group(proc: subprocess.Popen, steps: tuple = ((signal.SIGTERM, 10.0),)) -> None:
    """Each signal of `steps` in turn to the process group `proc` leads (it was started in a session of its
    own), waiting up to its seconds for `proc` to end; then SIGKILL."""
    for sig, wait_s in (*steps, (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def marked(marker: str) -> list[int]:
    """The ids of the processes whose environment holds MARKER=`marker`."""
    found = []
    tag = f"{MARKER}={marker}".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and tag in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue  # gone, or not ours to read
    return found


def sweep(marker: str) -> None:
    """Stop what a page started and left running (`ray start` daemons, a server's children), each by its id."""
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        for pid in marked(marker):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if wait_for(lambda: not marked(marker), wait_s):
            return


class Scratch:
    """The scratch folder, the clone's venv and the environment commands run in."""

    def __init__(self, venv: Path | None):
        self.root = Path(tempfile.mkdtemp(prefix="vdc-", dir="/tmp"))
        self.venv = venv  # None: `make install` builds base/.venv
        self.logs = self.root / "logs"
        self.logs.mkdir()
        (self.root / "curl").mkdir()
        (self.root / "curl" / ".curlrc").write_text("fail-with-body\nmax-time = 600\n")  # an HTTP error fails
        self.pages = 0

    def env(self, workdir: Path) -> dict[str, str]:
        """What `source .venv/bin/activate` in `workdir` leaves, in a clean environment of this run's own."""
        self.pages += 1
        tmp = self.root / f"t{self.pages}"  # Ray's own temp folder too: `ray start` here is this page's alone
        tmp.mkdir()
        drop = ("VITSCOPE_", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "RAY_ADDRESS", "CURL_HOME", MARKER)
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        env |= {"PATH": f"{workdir / '.venv' / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"}
        env |= {"VIRTUAL_ENV": str(workdir / ".venv"), "PYTHONPATH": str(workdir), "PYTHONUNBUFFERED": "1"}
        env |= {"TMPDIR": str(tmp), "RAY_TMPDIR": str(tmp), "CURL_HOME": str(self.root / "curl")}
        return env | {MARKER: str(workdir), "DOC_STATE": str(tmp / "state.sh")}

    def link_venv(self, clone: Path) -> None:
        """`clone/.venv` as links into the venv in use, with an install marker of its own (so `make` takes the
        venv as installed without touching it)."""
        real = self.venv or self.root / "base" / ".venv"
        (clone / ".venv").mkdir()
        for entry in real.iterdir():
            if entry.name != ".installed":
                (clone / ".venv" / entry.name).symlink_to(entry.resolve())
        (clone / ".venv" / ".installed").touch()

    def copy(self, src: Path, name: str) -> Path:
        """A copy of the clone `src`, its `.venv` linked rather than copied."""
        dest = self.root / name
        shutil.copytree(src, dest, symlinks=True, ignore=lambda d, names: {".venv"} if Path(d) == src else set())
        self.link_venv(dest)
        return dest


def run(script: str, cwd: Path, env: dict, log: Path, timeout_s: float, shown: str | None = None) -> str:
    """Run a bash script to its end, logged as `shown`; the result for the table."""
    start = time.monotonic()
    with open(log, "ab") as out:
        out.write(f"$ {shown or script}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            ["bash", "-c", script], cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return f"failed: still running after {timeout_s:.0f} s, stopped: {tail(log)}"
    took = time.monotonic() - start
    return f"ran: exit 0 in {took:.0f} s" if rc == 0 else f"failed: exit {rc} in {took:.0f} s: {tail(log)}"


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def probe(url: str) -> str:
    """What GET `url` answers: its status code, or why there is none."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.status)
    except urllib.error.HTTPError as e:
        return str(e.code)
    except (urllib.error.URLError, OSError) as e:
        return type(getattr(e, "reason", e)).__name__


@dataclass
class Running:
    row: Row
    proc: subprocess.Popen
    log: Path
    stop_after: int  # the index of the last command that uses it


def start_server(command: Command, cwd: Path, env: dict, log: Path) -> tuple[subprocess.Popen | None, str]:
    """Start a server in the background and wait for its URL to answer 200, under its deadline."""
    server = server_of(command.text)
    assert server is not None
    for port in () if server.on_ray else server.ports:  # a server this page just stopped may still hold it
        if not wait_for(lambda port=port: not port_taken(port), 30):
            return None, f"failed: port {port} is held by another process"
    if probe(server.url) == "200" and not wait_for(lambda: probe(server.url) != "200", 60):
        return None, f"failed: {server.url} answered 200 before the server started: a server of an earlier command"
    start = time.monotonic()
    with open(log, "ab") as out:
        out.write(f"$ {command.text}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            ["bash", "-c", f'source "$DOC_STATE"\n{command.text}\n'], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    answer = ""
    while time.monotonic() - start < server.deadline_s:
        if answer != (answer := probe(server.url)):
            with open(log, "a") as out:  # each new answer, for a reader of the log
                print(f"[doc_commands {time.monotonic() - start:.0f} s] GET {server.url}: {answer}", file=out)
        if answer == "200":
            return proc, f"ran: {server.url} answered 200 in {time.monotonic() - start:.0f} s"
        try:
            rc = proc.wait(0.5)
            return None, f"failed: exited with code {rc} before {server.url} answered: {tail(log)}"
        except subprocess.TimeoutExpired:
            continue
    kill_group(proc, CTRL_C)
    return None, f"failed: {server.url} did not answer 200 within {server.deadline_s:.0f} s: {tail(log)}"


def stop_server(running: Running, commands: list[Command]) -> None:
    """Stop a server after its last user; a server that died while in use fails its row."""
    rc = running.proc.poll()
    if rc is not None:
        running.row.result = f"failed: {running.row.result[5:]}, then exited with code {rc} while in use: "
        running.row.result += tail(running.log)
        return
    kill_group(running.proc, CTRL_C)
    running.row.result += f"; stopped after line {commands[running.stop_after].line}"


def make_placeholders(command: Command, made: set[str], cwd: Path, env: dict, log: Path) -> str | None:
    """Make the placeholders `command` names that are not made yet; a failure's message, or None."""
    for text, setup, _ in PLACEHOLDERS:
        if setup and text in command.text and text not in made:
            made.add(text)
            result = run(setup, cwd, env, log, 1800)
            if result.startswith("failed"):
                return f"failed: could not make the placeholder {text}: {result}"
    return None


def run_page(commands: list[Command], workdir: Path, env: dict, logs: Path, timeout_s: float) -> list[Row]:
    """Run one page's commands in order in `workdir`; servers stop after their last user."""
    rows: list[Row] = []
    running: list[Running] = []
    made: set[str] = set()
    block = None
    try:
        for i, command in enumerate(commands):
            if command.block != block:
                block = command.block
                Path(env["DOC_STATE"]).write_text("")
            rows.append(row := Row(command.file, command.key, ""))
            kind, detail = classify(command)
            log = logs / f"{command.line}.log"
            row.result = f"not run: {detail}" if kind == "not run" else ""
            row.result = row.result or make_placeholders(command, made, workdir, env, log) or ""
            if not row.result and kind == "server":
                proc, row.result = start_server(command, workdir, env, log)
                server = server_of(command.text)
                if proc and server:
                    running.append(Running(row, proc, log, users(commands, i, server)))
            elif not row.result:
                row.result = run(STATEFUL.format(command=command.text), workdir, env, log, timeout_s, command.text)
            print(f"{command.file}:{command.line}: {row.result[:160]}", file=sys.stderr, flush=True)
            for r in [r for r in running if r.stop_after <= i]:
                stop_server(r, commands)
                running.remove(r)
    finally:
        for r in running:
            stop_server(r, commands)
        sweep(env[MARKER])
    return rows


def setup_row(scratch: Scratch, command: str, cwd: Path, env: dict, name: str) -> Row:
    row = Row(SETUP, command, run(command, cwd, env, scratch.logs / f"setup-{name}.log", 3600))
    print(f"{SETUP} {command}: {row.result[:160]}", file=sys.stderr, flush=True)
    return row


def clone_head(scratch: Scratch) -> Row:
    """`base/`: a clone of HEAD, so that what is tested is what is committed."""
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    command = f"git clone -q {ROOT} base && git -C base checkout -q --detach {sha}"
    return setup_row(scratch, command, scratch.root, dict(os.environ), "clone")


def run_pages(pages: dict[str, list[Command]], scratch: Scratch, timeout_s: float) -> list[Row]:
    """Install the clone, build the sample when a page needs it, then run each page in a copy of its own."""
    base = scratch.root / "base"
    if scratch.venv:
        scratch.link_venv(base)
    rows = [setup_row(scratch, "make install", base, scratch.env(base), "install")]
    sample = None
    if any(page != README for page in pages) and not rows[-1].failed:
        sample = scratch.copy(base, "sample")
        rows.append(setup_row(scratch, SAMPLE_SETUP, sample, scratch.env(sample), "sample"))
        sweep(str(sample))
    for page, commands in pages.items():
        start = base if page == README else sample
        if any(r.failed for r in rows if r.file == SETUP) or start is None:
            rows += [Row(page, c.key, "failed: the setup above failed") for c in commands]
            continue
        workdir = scratch.copy(start, "pages/" + page.replace("/", "_"))
        env, logs = scratch.env(workdir), scratch.logs / page.replace("/", "_")
        logs.mkdir(parents=True)
        for command, _ in PREREQUISITES.get(page, []):
            rows.append(Row(f"{page} (before)", command, run(command, workdir, env, logs / "before.log", timeout_s)))
        rows += run_page(commands, workdir, env, logs, timeout_s)
    return rows


def select(root: Path, only: list[str]) -> dict[str, list[Command]] | None:
    """The commands of the docs under `root` by page (those of `only`, if given); None after printing why not."""
    commands = parse_docs(root)
    problems = coverage_problems(commands)
    pages: dict[str, list[Command]] = {}
    for c in commands:
        if not only or c.file in only:
            pages.setdefault(c.file, []).append(c)
    problems += [f"{page} holds no shell command" for page in sorted(set(only) - set(pages))]
    for problem in problems:
        print(problem, file=sys.stderr)
    return None if problems else pages


def table(rows: list[Row]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| file | command | result |", "|---|---|---|"]
    return "\n".join(lines + [f"| {r.file} | `{cell(r.command)}` | {cell(r.result)} |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    import tests.doc_commands

    parser = argparse.ArgumentParser(
        prog="python -m tests.doc_commands", description=tests.doc_commands.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--venv", type=Path, help="reuse this venv instead of `make install` building one")
    parser.add_argument("--only", action="append", default=[], help="run this page only (repeatable)")
    parser.add_argument("--list", action="store_true", help="print what would happen to each command; run nothing")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (clone, copies, logs)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a foreground command may take")
    args = parser.parse_args(argv)
    if args.list:
        pages = select(ROOT, args.only)
        if pages is not None:
            print(
                table([Row(c.file, c.key, ": ".join(filter(None, classify(c)))) for cs in pages.values() for c in cs])
            )
        return 0 if pages is not None else 2
    if subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip():
        print("uncommitted changes are not tested: the run is of HEAD", file=sys.stderr)
    scratch = Scratch(args.venv.resolve() if args.venv else None)
    try:
        rows = [clone_head(scratch)]
        pages = select(scratch.root / "base", args.only) if not rows[0].failed else {}
        if pages is None:
            return 2
        rows += run_pages(pages, scratch, args.timeout)
    finally:
        if args.keep:
            print(f"kept {scratch.root} (logs in {scratch.logs})", file=sys.stderr)
        else:
            shutil.rmtree(scratch.root, ignore_errors=True)
    print(table(rows))
    return 1 if any(r.failed for r in rows) else 0
