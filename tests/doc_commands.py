"""Every shell command of README.md and docs/**/*.md, run as written in a fresh clone of HEAD.

    .venv/bin/python -m tests.doc_commands                       # `make install` in the clone, then every page
    .venv/bin/python -m tests.doc_commands --venv .venv          # reuse a venv instead (what `make doc-commands` does)
    .venv/bin/python -m tests.doc_commands --only README.md --only docs/guide/serve.md --keep
    .venv/bin/python -m tests.doc_commands --list                # what would happen to each command; nothing runs

The commands are those of the ```bash, ```sh, ```shell and ```console fences (in console fences, the lines after
`$ `), in order, one per line or per `\\`-continued run of lines; `#` comments are dropped. Each page runs in a
copy of the clone of its own: README.md from the bare clone (its `make demo` builds the sample), every other
page from the clone with the sample trained and exported (`make export`), as README leaves it, plus what it
takes from another page (PREREQUISITES). A page's commands run in order, so a later one reads what an earlier one
wrote. Every fenced block starts from the environment
`source .venv/bin/activate` leaves (the venv's bin first on PATH); what a block exports holds for the rest of
that block. `curl` runs with `--fail-with-body` (a .curlrc in a scratch CURL_HOME), so an HTTP error fails its
command. With `--venv PATH` the clone's `.venv` is a folder of links into PATH with a marker of its own (so
`make install` only runs npm), and PYTHONPATH puts the clone first: an editable install in PATH imports the
clone's code, not its own. Ray's temporary folder (RAY_TMPDIR) is the run's own, so `ray start` and
`--ray-address auto` never meet another user's cluster, and every process a page started is stopped by its id
when the page ends.

A command either runs or is listed in NOT_RUN with the reason; one naming a program outside PROGRAMS that is not
listed, or a NOT_RUN entry the docs no longer hold, fails the run before anything starts (tests/test_doc_commands.py
checks the same on every `make test`). A server (`server_of`: vit-serve, vit-train review, make demo, make web,
python -m http.server, serve run) starts in the background and must answer its URL with 200 within its deadline; it is
stopped as a reader stops it, Ctrl-C first, after the last later command that names its port or writes to the
repository it watches. Placeholders a reader replaces are made real
in the page's copy before its first command that names them (PLACEHOLDERS). The result is a markdown table on
stdout: page, command, result; the exit status is 1 when a command failed.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELL_FENCES = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")

# Commands of the docs that this script does not run, and why. The key is the command as parsed (comment
# dropped, continuation lines joined, runs of spaces as one).
NOT_RUN: dict[str, str] = {
    "make test": "the test suite itself, which `.ci/run` runs on every change (and which checks this table)",
    "vit-train fit --config configs/finetune_timm.yaml --data.root path/to/images --trainer.default_root_dir runs/ft":
        "downloads timm's weights from the Hugging Face hub, which this machine cannot reach "
        "(the offline variant below runs)",
    "vit-train fit --config configs/vit_base.yaml --data.root path/to/images --trainer.devices 4 "
    "--trainer.strategy ddp": "four GPUs",
    "sudo apt-get install dataset-fashion-mnist": "installs a system package as root: this script changes nothing "
        "outside its scratch folder",
    "vit-fashion-mnist --out data/fmnist": "reads the idx files that the dataset-fashion-mnist package installs",
    "vit-train fit --config configs/small_images.yaml --data.root data/fmnist --data.img_size 28 "
    "--trainer.default_root_dir runs/fmnist": "the half-hour Fashion-MNIST training",
    "vit-train fit --config configs/small_images.yaml --data.root data/fmnist --data.img_size 28 "
    "--trainer.default_root_dir runs/fmnist --trainer.enable_progress_bar false":
        "the half-hour Fashion-MNIST training",
    "vit-train fit --config configs/small_images.yaml --data.root data/fmnist --data.img_size 28 "
    "--model.teacher runs/fmnist/checkpoints/best.ckpt --trainer.default_root_dir runs/fmnist-distilled":
        "needs runs/fmnist, the half-hour Fashion-MNIST training, as its teacher",
    "vit-train fit --data.root data/fmnist --trainer.default_root_dir runs/auto --data.augment.hflip 0":
        "needs data/fmnist (dataset-fashion-mnist); half an hour on CPU",
    "vit-export runs/fmnist/checkpoints/best.ckpt -o artifacts/fmnist.onnx --no-gradients":
        "needs runs/fmnist, the half-hour Fashion-MNIST training",
    "vit-predict artifacts/fmnist.onnx data/fmnist/val/shirt --coverage 0.95 --format json --top-k 2 | head -2":
        "needs artifacts/fmnist.onnx, from the half-hour Fashion-MNIST training",
    "vit-serve artifacts/fmnist.onnx --no-ui": "needs artifacts/fmnist.onnx, from the half-hour Fashion-MNIST "
        "training",
    "curl -s -F file=@data/fmnist/val/shirt/00007.png 'http://127.0.0.1:7860/v1/classify?coverage=0.95&top_k=2'":
        "asks the Fashion-MNIST server above",
    "vit-predict artifacts/sample.onnx s3://bucket/night/ --ray --ray-address auto --workers 16 "
    "--out preds.parquet": "object storage and a 16-worker Ray cluster",
    "tritonserver --model-repository models/": "Triton Inference Server (a container image); no container engine "
        "runs here",
    'docker run --rm -p 8000:8000 -p 8001:8001 -v "$PWD/artifacts/triton:/models" '
    "nvcr.io/nvidia/tritonserver:24.08-py3 tritonserver --model-repository=/models":
        "Docker: no container engine runs here",
    # docs/benchmarks: how each figure was taken, on a quiet machine; `make bench` reruns the benchmarks
    "for c in 9382f68 bebd696; do mkdir -p /tmp/vitscope-$c && git archive $c | tar -x -C /tmp/vitscope-$c; done":
        "a benchmark's old trees, unpacked outside the clone",
    "sudo apt-get install dataset-fashion-mnist && vit-fashion-mnist --out data/fmnist": "installs a system "
        "package as root: this script changes nothing outside its scratch folder",
    "vit-train fit --config configs/small_images.yaml --config runs/openset_budget.yaml --data.root data/fmnist8 "
    "--data.img_size 28 --trainer.default_root_dir runs/fmnist8 --trainer.enable_progress_bar false "
    "--overwrite true": "a benchmark's 12-minute open-set training on Fashion-MNIST",
    "vit-sample-data --out data/digits": "a benchmark's record of its data: `make export`, which every page but "
        "README starts from, writes the same sample (the Makefile's sample target)",
    "vit-train fit --config configs/sample.yaml --trainer.default_root_dir runs/sample "
    "--trainer.enable_progress_bar false --overwrite true": "a benchmark's record of its model: `make export`, "
        "which every page but README starts from, runs this training (the Makefile's train target)",
    ".venv/bin/python -m benchmarks.fashion_mnist": "the half-hour Fashion-MNIST training and its benchmark",
    ".venv/bin/python -m benchmarks.trust --fmnist runs/fmnist-bench --openset runs/fmnist8 --sample runs/sample":
        "a benchmark of the Fashion-MNIST runs (half an hour + 12 minutes of training)",
}  # fmt: skip

# Placeholders a reader replaces with their own, made real in a page's copy before the first command that
# names them: (text, shell commands run in the copy, why that is honest). None: nothing to make.
PLACEHOLDERS: list[tuple[str, str | None, str]] = [
    (
        "path/to/images",
        "make --quiet sample && for c in 0 1 2 3; do mkdir -p path/to/images/$c && "
        "cp $(ls -d data/digits/$c/*.png | head -6) path/to/images/$c/; done",
        "the reader's folder of class folders: 6 sample digits in each of 4 classes (16 train, 4 val, 4 calibration "
        "images) keep the 100-epoch, 224-px recipes to minutes on CPU",
    ),
    (
        "path/to/held-out",
        "make --quiet sample && for c in 0 1 2 3; do mkdir -p path/to/held-out/$c && "
        "cp $(ls -d data/digits/$c/*.png | tail -6) path/to/held-out/$c/; done",
        "a labelled folder that training never saw, for vit-export --calibrate: 6 other sample digits in each of "
        "path/to/images' 4 classes",
    ),
    (
        "weights/vit_small_patch16_224.safetensors",
        'mkdir -p weights && python -c "import timm, safetensors.torch as st; st.save_file(timm.create_model('
        "'vit_small_patch16_224').state_dict(), 'weights/vit_small_patch16_224.safetensors')\"",
        "a local timm checkpoint of that architecture: the hub is out of reach here, so it holds timm's initial "
        "weights (the names and shapes a downloaded file has)",
    ),
    (
        "artifacts/sample-new.onnx",
        "cp artifacts/sample.onnx artifacts/sample-new.onnx",
        "the newer export to roll out: the sample's own file stands in, loaded and checked as version 2 the same way",
    ),
    ("vit.example.org", None, "a name --allowed-hosts answers: the server never resolves it, nothing to make"),
]

# Commands run before a page's first one: what it takes from another page, and why.
PREREQUISITES: dict[str, list[tuple[str, str]]] = {
    "docs/guide/deploy.md": [
        (
            "vit-export runs/sample/checkpoints/best.ckpt -o artifacts/sample.onnx --triton-repo artifacts/models",
            "its Ray section serves the repository that the model-repository guide builds",
        )
    ],
}

# Programs a command may run in the foreground here. A command naming any other program must be a server
# (SERVERS) or be listed in NOT_RUN, so that a new kind of command is never run, or skipped, unseen.
PROGRAMS = {
    "make", "source", "export", "python", "python3", ".venv/bin/python", "serve-env/bin/pip", "curl", "grep",
    "head", "ls", "printf", "mkdir", "cp", "mv", "openssl", "ray", "vit-train", "vit-export", "vit-predict",
    "vit-sample-data",
}  # fmt: skip


@dataclass(frozen=True)
class Command:
    """One shell command of the docs."""

    file: str  # relative to the repository root
    line: int  # of its first line
    block: int  # the fenced block it is in, counted from 0 in its file
    text: str  # as bash runs it: continuation lines joined, the comment dropped

    @property
    def key(self) -> str:
        return " ".join(self.text.split())


@dataclass(frozen=True)
class Server:
    """A command that serves until stopped: where it answers when ready, and what it holds."""

    url: str
    ports: tuple[int, ...]
    deadline_s: float  # to answer `url` with 200
    on_ray: bool = False  # its port may be held already, by the proxy of the Ray Serve cluster it joins
    watches: str | None = None  # a model repository it loads new versions from (commands writing there use it)


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md, then the docs site's pages in name order."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def strip_comment(line: str) -> str:
    """`line` without its `#` comment: a `#` outside quotes, at the start or after a blank."""
    quote, escaped = None, False
    for i, c in enumerate(line):
        if escaped:
            escaped = False
        elif c == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def block_commands(lines: list[str], console: bool) -> list[tuple[int, str]]:
    """(index of the first line, command) for each command of a fenced block's lines."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    first = 0
    for i, raw in enumerate(lines):
        line = raw.strip()
        if console and not pending:
            if not line.startswith("$ "):
                continue  # the output shown after a command
            line = line[2:]
        code = strip_comment(line)
        if not pending and not code:
            continue
        first = i if not pending else first
        if code.endswith("\\"):
            pending.append(code[:-1].rstrip())
            continue
        out.append((first, " ".join([*pending, code]).strip()))
        pending = []
    if pending:
        out.append((first, " ".join(pending)))
    return out


def parse_file(path: Path, root: Path = ROOT) -> list[Command]:
    """Every command of the shell fences of the markdown file `path`, in order."""
    rel = path.relative_to(root).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    commands: list[Command] = []
    i, block = 0, 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent, start = m["fence"], len(m["indent"]), i + 1
        end = start
        while end < len(lines) and not lines[end].strip().startswith(fence[0] * len(fence)):
            end += 1
        if m["lang"] in SHELL_FENCES:
            body = [line[indent:] if line[:indent].isspace() else line.lstrip() for line in lines[start:end]]
            for offset, text in block_commands(body, console=m["lang"] == "console"):
                commands.append(Command(rel, start + offset + 1, block, text))
            block += 1
        i = end + 1
    return commands


def parse_docs(root: Path = ROOT) -> list[Command]:
    return [c for path in doc_files(root) for c in parse_file(path, root)]


def programs(text: str) -> list[str]:
    """The programs a command line starts: the first word of each pipeline stage, list and `$(...)`."""
    found: list[str] = []
    word, quote, expect, i = "", None, True, 0
    while i <= len(text):
        c = text[i] if i < len(text) else " "
        two = text[i : i + 2]
        if quote and c != quote and not (quote == '"' and two == "$("):
            word += c
        elif quote and c == quote:
            quote, word = None, word + c
        elif c in "'\"":
            quote, word = c, word + c
        elif two in ("&&", "||", "$("):
            word, expect, i = "", True, i + 1
        elif c in "|;(`":
            word, expect = "", True
        elif c == ")":
            word, expect = "", False
        elif c.isspace():
            if expect and word and not re.match(r"^\w+=", word):
                found.append(word)
                expect = False
            word = ""
        else:
            word += c
        i += 1
    return found


def server_of(text: str) -> Server | None:
    """The server a command starts, or None for a command that returns by itself."""
    words = shlex.split(text)
    while words and re.match(r"^\w+=", words[0]):  # `NAME=value vit-serve ...`: the environment of one command
        words = words[1:]
    if words[:2] in (["make", "demo"], ["make", "serve"]):
        return Server("http://127.0.0.1:7860/readyz", (7860,), 1800)  # a fresh clone trains first
    if words[:2] in (["make", "web"], ["make", "docs-serve"]):
        return Server("http://127.0.0.1:8000/", (8000,), 1800)
    if words[:3] == ["python", "-m", "http.server"]:
        port = int(words[3]) if len(words) > 3 and words[3].isdigit() else 8000
        host = words[words.index("--bind") + 1] if "--bind" in words else "127.0.0.1"
        return Server(f"http://{host}:{port}/", (port,), 60)
    if words[:2] == ["serve", "run"]:
        return Server("http://127.0.0.1:8000/readyz", (8000,), 600, on_ray=True)
    if words[:2] == ["vit-train", "review"] and "--help" not in words:
        flags = {a: b for a, b in zip(words, words[1:], strict=False) if a.startswith("--")}
        port = int(flags.get("--port", 7860))
        return Server(f"http://{flags.get('--host', '127.0.0.1')}:{port}/", (port,), 300)
    if words[:1] == ["vit-serve"] and "--help" not in words:
        flags = {a: b for a, b in zip(words, words[1:], strict=False) if a.startswith("--")}
        ray = "--ray" in words
        port = int(flags.get("--port", 8000 if ray else 7860))
        extra = tuple(int(flags[f]) for f in ("--grpc-port", "--probe-port") if f in flags)
        model = words[1]
        watches = None if model.endswith(".onnx") else model.rstrip("/")
        url = f"http://{flags.get('--host', '127.0.0.1')}:{port}/readyz"
        return Server(url, (port, *extra), 600 if ray else 300, ray, watches)
    return None


def classify(command: Command) -> tuple[str, str]:
    """("not run", reason), ("server", url), ("run", "") or ("unknown", what to do)."""
    if command.key in NOT_RUN:
        return "not run", NOT_RUN[command.key]
    server = server_of(command.text)
    if server:
        return "server", server.url
    unknown = [p for p in programs(command.text) if p not in PROGRAMS]
    if unknown:
        return "unknown", f"runs {', '.join(unknown)}: add it to PROGRAMS, or list the command in NOT_RUN"
    return "run", ""


def coverage_problems(commands: list[Command]) -> list[str]:
    """What breaks the rule: a command neither run nor listed, or a listed command or placeholder gone."""
    problems = [f"{c.file}:{c.line}: `{c.key}` {why}" for c in commands if (kind := classify(c))[0] == "unknown"
                for why in [kind[1]]]  # fmt: skip
    keys = {c.key for c in commands}
    problems += [f"NOT_RUN lists `{key}`, which no page holds any more" for key in NOT_RUN if key not in keys]
    texts = " ".join(keys)
    problems += [f"PLACEHOLDERS lists `{p}`, which no command names" for p, _, _ in PLACEHOLDERS if p not in texts]
    pages = {c.file for c in commands}
    problems += [f"PREREQUISITES names {page}, which holds no command" for page in PREREQUISITES if page not in pages]
    return problems


def users(commands: list[Command], i: int, server: Server) -> int:
    """The index of the last command that uses the server `commands[i]` starts (`i` when none does): one that
    names its port or writes to the repository it watches, before another server takes one of its ports."""
    last = i
    for j in range(i + 1, len(commands)):
        other = server_of(commands[j].text)
        if other and set(other.ports) & set(server.ports):
            break
        if other:
            continue  # another server reading the same files does not use this one
        text = commands[j].text
        if any(f":{p}" in text for p in server.ports) or (server.watches and server.watches in text):
            last = j
    return last


if __name__ == "__main__":
    from tests.doc_runner import main

    raise SystemExit(main())
