"""The docs' commands and tests/doc_commands.py stay in step: every command is run or listed with its reason.

Parsing only (the full run is `make doc-commands`), so it runs in every `make test`.
"""

from __future__ import annotations

from pathlib import Path

from tests.doc_commands import (
    Command,
    classify,
    coverage_problems,
    parse_docs,
    parse_file,
    programs,
    server_of,
    users,
)

PAGE = """# A page

```bash
make demo   # a comment
# a comment line
vit-train fit --config a.yaml \\
  --data.root path/to/images   # the end of a continued command
curl -s 'http://127.0.0.1:7860/v1/classify?top_k=3#frag'
```

1. In a list:
   ```sh
   mkdir artifacts/models/x
   ```

```console
$ vit-predict m.onnx img.png
img.png 7 0.99
```

```python
print("not a shell command")
```
"""


def test_every_docs_command_is_run_or_listed_and_every_listed_one_exists():
    assert coverage_problems(parse_docs()) == []


def test_commands_are_split_joined_and_stripped_of_comments(tmp_path: Path):
    (tmp_path / "page.md").write_text(PAGE)
    commands = parse_file(tmp_path / "page.md", tmp_path)
    assert [(c.line, c.block, c.key) for c in commands] == [
        (4, 0, "make demo"),
        (6, 0, "vit-train fit --config a.yaml --data.root path/to/images"),
        (8, 0, "curl -s 'http://127.0.0.1:7860/v1/classify?top_k=3#frag'"),
        (13, 1, "mkdir artifacts/models/x"),
        (17, 2, "vit-predict m.onnx img.png"),
    ]


def test_programs_are_found_in_pipelines_lists_and_substitutions():
    assert programs("export KEY=$(openssl rand -hex 24)") == ["export", "openssl"]
    assert programs("printf '%s\\n' a/$(ls a | head -1) > x.txt && X=1 vit-predict m x") == [
        "printf", "ls", "head", "vit-predict",
    ]  # fmt: skip


def test_a_command_of_an_unknown_program_must_be_listed():
    kind, why = classify(Command("docs/x.md", 1, 0, "kubectl apply -f vit.yaml"))
    assert kind == "unknown" and "kubectl" in why


def test_a_server_stops_after_its_last_user_before_another_takes_its_port():
    texts = [
        "vit-serve m.onnx --port 7860 --grpc-port 8001",
        "curl -s http://127.0.0.1:7860/readyz",
        "vit-predict m.onnx img.png",
        "vit-serve artifacts/models --no-ui --probe-port 7861",
        "mv artifacts/models/sample/.2.incoming artifacts/models/sample/2",
        "curl -s http://127.0.0.1:7860/v2/models",
    ]
    commands = [Command("p.md", i, 0, t) for i, t in enumerate(texts)]
    first, repo = server_of(texts[0]), server_of(texts[3])
    assert first is not None and first.ports == (7860, 8001)
    assert repo is not None and repo.watches == "artifacts/models" and repo.ports == (7860, 7861)
    assert users(commands, 0, first) == 1
    assert users(commands, 3, repo) == 5
