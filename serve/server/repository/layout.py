"""The model repository on disk, in the layout `vit-export --triton-repo` writes (Triton's own):

    DIR/<name>/config.pbtxt        optional here; its `version_policy` picks the versions to serve
    DIR/<name>/labels.txt          optional; when present it must list the file's own class names
    DIR/<name>/<version>/model.onnx

`version_policy` follows Triton's `config.pbtxt`: `{ latest { num_versions: N } }` (the default, N = 1),
`{ all { } }` or `{ specific { versions: [1, 3] } }`. A version is a folder named by a positive integer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

MODEL_FILE = "model.onnx"
CONFIG_FILE = "config.pbtxt"
LABELS_FILE = "labels.txt"
_LATEST = re.compile(r"latest\s*:?\s*\{\s*num_versions\s*:\s*(\d+)\s*\}")
_ALL = re.compile(r"\ball\s*:?\s*\{\s*\}")
_SPECIFIC = re.compile(r"specific\s*:?\s*\{([^}]*)\}")


@dataclass(frozen=True)
class VersionPolicy:
    """Which of a model's versions on disk are served: the `latest` N, `all`, or `specific` ones."""

    kind: str = "latest"
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    def select(self, available: list[int]) -> list[int]:
        """The versions to serve out of `available`, oldest first."""
        ordered = sorted(available)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if v in self.versions]
        return ordered[-self.num_versions :]


def parse_version_policy(config: str) -> VersionPolicy:
    """The `version_policy` of a `config.pbtxt` text (Triton's default, the latest one, when it has none).

    Raises:
        ValueError: a `version_policy` this reader cannot make sense of.
    """
    start = config.find("version_policy")
    if start < 0:
        return VersionPolicy()
    text = config[start:]
    if m := _LATEST.search(text):
        if int(m.group(1)) < 1:
            raise ValueError("version_policy latest needs num_versions of at least 1")
        return VersionPolicy("latest", int(m.group(1)))
    if _ALL.search(text):
        return VersionPolicy("all")
    if m := _SPECIFIC.search(text):
        versions = tuple(int(v) for v in re.findall(r"\d+", m.group(1)))
        if versions:
            return VersionPolicy("specific", versions=versions)
    raise ValueError(
        "version_policy must be { latest { num_versions: N } }, { all { } } or { specific { versions: [1, 2] } }"
    )


@dataclass
class ModelFolder:
    """One model of the repository: its folder, its version policy and the version files found on disk."""

    name: str
    folder: Path
    policy: VersionPolicy = field(default_factory=VersionPolicy)
    files: dict[int, Path] = field(default_factory=dict)  # version -> its model.onnx

    def wanted(self) -> dict[int, Path]:
        """The version files the policy serves."""
        return {v: self.files[v] for v in self.policy.select(list(self.files))}

    def labels(self) -> list[str] | None:
        path = self.folder / LABELS_FILE
        return path.read_text(encoding="utf-8").splitlines() if path.is_file() else None


def scan_model(folder: Path) -> ModelFolder:
    """One model folder as it is now (its policy re-read from config.pbtxt)."""
    config = folder / CONFIG_FILE
    policy = parse_version_policy(config.read_text(encoding="utf-8")) if config.is_file() else VersionPolicy()
    files = {
        int(d.name): d / MODEL_FILE
        for d in folder.iterdir()
        if d.is_dir() and d.name.isdigit() and int(d.name) > 0 and (d / MODEL_FILE).is_file()
    }
    return ModelFolder(folder.name, folder, policy, files)


def scan(root: Path) -> dict[str, ModelFolder]:
    """Every model folder under `root` (a folder with a config.pbtxt or a numbered version folder), by name.

    Raises:
        ValueError: `root` holds no model in this layout, or a config that cannot be read.
    """
    models = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        has_version = any(d.is_dir() and d.name.isdigit() for d in folder.iterdir())
        if (folder / CONFIG_FILE).is_file() or has_version:
            try:
                models[folder.name] = scan_model(folder)
            except ValueError as e:
                raise ValueError(f"{folder / CONFIG_FILE}: {e}") from None
    if not models:
        raise ValueError(
            f"{root} holds no model: expected <name>/<version>/{MODEL_FILE} (as vit-export --triton-repo writes)"
        )
    return models


def file_stamp(path: Path) -> tuple[int, int]:
    """(size, modification time): a file still being copied changes it, so a failed load is retried."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def default_model_file(root: Path, default_model: str = "") -> tuple[str, Path]:
    """The default model's name (`default_model`, else the first by name) and its newest wanted version file.

    Raises:
        ValueError: no such model, or it has no version file.
    """
    models = scan(root)
    name = default_model or min(models)
    if name not in models:
        raise ValueError(f"--default-model {name!r} is not in {root}; it holds {', '.join(models)}")
    wanted = models[name].wanted()
    if not wanted:
        raise ValueError(f"{root / name} has no version to serve: expected {root / name}/<version>/{MODEL_FILE}")
    return name, wanted[max(wanted)]
