"""The model repository on disk, in the layout `vit-export --triton-repo` writes (Triton's own):

    DIR/<name>/config.pbtxt        optional here; its `version_policy` picks the versions to serve
    DIR/<name>/labels.txt          optional; when present it must list the file's own class names
    DIR/<name>/<version>/model.onnx

`config.pbtxt` is read as Triton reads it: protobuf text format against Triton's `ModelConfig` message
(`model_config.proto`, the part vitscope needs, compiled by `make protos`), so comments, field order and
whitespace mean what they mean to Triton, and a misspelt field is refused. The `version_policy` is
`{ latest { num_versions: N } }` (the default, N = 1), `{ all { } }` or `{ specific { versions: [1, 3] } }`.

A version is a folder named by ASCII digits without a leading zero, as Triton's documentation states:
`0`, `01`, `²` and `١` are not versions and are skipped (so `01` never collides with `1`).

A config that cannot be read fails its own model only: `scan` returns that folder with `error` set, and it
serves nothing until the file is fixed. The poller scans every few seconds under the repository lock, so a
config is parsed again only when its size, modification or change time, or inode changed (`read_policy`), and configs
and labels.txt files are capped in size.
"""

from __future__ import annotations

import functools
import os
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format

from serve.runtime.row_formats import parquet_text
from serve.server.repository.model_config_pb2 import ModelConfig

LINE_BREAKING = ("Cc", "Zl", "Zp")  # Unicode categories of \n, \x1b and the like, U+2028 and U+2029
MODEL_FILE = "model.onnx"
CONFIG_FILE = "config.pbtxt"
LABELS_FILE = "labels.txt"
MAX_CONFIG_BYTES = 64 << 10  # Triton's configs are a few KiB; parsing a stray huge one stalls every poll
MAX_LABELS_BYTES = 1 << 20  # a name per class: ample for tens of thousands of classes
MAX_VERSION = 2**63 - 1  # Triton's versions are int64
POLICY_FORMS = "version_policy must be { latest { num_versions: N } }, { all { } } or { specific { versions: [1, 2] } }"
# Triton's ModelConfig fields left out of model_config.proto: they describe models vitscope cannot serve
TRITON_ONLY = (
    "batch_input",
    "batch_output",
    "sequence_batching",
    "ensemble_scheduling",
    "cc_model_filenames",
    "model_operations",
    "model_repository_agents",
    "model_metrics",
)


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


def parse_config(config: str) -> ModelConfig:
    """A `config.pbtxt` text as Triton's `ModelConfig`.

    Raises:
        ValueError: text Triton would refuse (a syntax error, an unknown or repeated field, a bad value), or a
            field of Triton's for models vitscope cannot serve.
    """
    try:
        return text_format.Parse(config, ModelConfig())
    except text_format.ParseError as e:
        unsupported = next((f for f in TRITON_ONLY if f'no field named "{f}"' in str(e)), None)
        if unsupported:
            raise ValueError(
                f"{unsupported} is Triton's field for a model vitscope does not serve (sequence, ensemble or "
                "custom-operation models); serve this model with Triton, or remove the field"
            ) from None
        hint = f" ({POLICY_FORMS})" if "ModelVersionPolicy" in str(e) else ""
        raise ValueError(f"{e}; fix it as for Triton{hint} (its schema: Triton's model_config.proto)") from None


def parse_version_policy(config: str) -> VersionPolicy:
    """The `version_policy` of a `config.pbtxt` text (Triton's default, the latest one, when it has none).

    Raises:
        ValueError: a config Triton would refuse (`parse_config`), or a policy that serves nothing.
    """
    parsed = parse_config(config)
    if not parsed.HasField("version_policy"):
        return VersionPolicy()
    policy = parsed.version_policy
    kind = policy.WhichOneof("policy_choice")
    if kind == "latest":
        if policy.latest.num_versions < 1:
            raise ValueError("version_policy latest needs num_versions of at least 1")
        return VersionPolicy("latest", policy.latest.num_versions)
    if kind == "all":
        return VersionPolicy("all")
    if kind == "specific" and policy.specific.versions:
        return VersionPolicy("specific", versions=tuple(policy.specific.versions))
    raise ValueError(f"version_policy names no policy (or no version): {POLICY_FORMS}")


def read_text(path: Path, limit: int, usual: str) -> str:
    """The UTF-8 text of a small file, at most `limit` bytes (`usual` says how large such a file is).

    Raises:
        ValueError: the file is larger, or not UTF-8.
        OSError: it cannot be read.
    """
    with path.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"it is over {limit:,} bytes; {usual}: write it again")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"it is not UTF-8 text ({e})") from None


def read_config(path: Path) -> str:
    """The text of a `config.pbtxt`, at most `MAX_CONFIG_BYTES` (`read_text`)."""
    return read_text(path, MAX_CONFIG_BYTES, "Triton's model configs are a few KiB")


def read_policy(path: Path) -> VersionPolicy:
    """The version policy of a `config.pbtxt`, parsed only when the file is new or changed since the last call.

    Raises:
        ValueError: a config Triton would refuse (`parse_version_policy`), or one over `MAX_CONFIG_BYTES`.
        OSError: it cannot be read.
    """
    st = path.stat()
    policy = _policy_of(str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if isinstance(policy, str):
        raise ValueError(policy)
    return policy


@functools.lru_cache(maxsize=1024)
def _policy_of(path: str, size: int, mtime_ns: int, ctime_ns: int, inode: int) -> VersionPolicy | str:
    """The policy of the file `path` as it was at (size, mtime_ns, ctime_ns, inode), or why it is refused (cached
    too)."""
    try:
        return parse_version_policy(read_config(Path(path)))
    except ValueError as e:
        return str(e)


def version_of(name: str) -> int | None:
    """The version a folder's name stands for: ASCII digits without a leading zero, as in Triton; else None."""
    if not (name.isascii() and name.isdigit()) or name.startswith("0") or len(name) > len(str(MAX_VERSION)):
        return None
    version = int(name)
    return version if version <= MAX_VERSION else None


@dataclass
class ModelFolder:
    """One model of the repository: its folder, its version policy and the version files found on disk.

    `error`, when not empty, is why this model cannot be served (its config cannot be read): it serves nothing.
    """

    name: str
    folder: Path
    policy: VersionPolicy = field(default_factory=VersionPolicy)
    files: dict[int, Path] = field(default_factory=dict)  # version -> its model.onnx
    error: str = ""

    def wanted(self) -> dict[int, Path]:
        """The version files the policy serves (none while the model has an error)."""
        if self.error:
            return {}
        return {v: self.files[v] for v in self.policy.select(list(self.files))}

    def labels(self) -> list[str] | None:
        """The class names of labels.txt, one a line (None: the folder has none).

        Raises:
            ValueError: it is over `MAX_LABELS_BYTES`, or not UTF-8.
            OSError: it cannot be read.
        """
        path = self.folder / LABELS_FILE
        if not path.is_file():
            return None
        return read_text(path, MAX_LABELS_BYTES, "labels.txt holds one class name a line").splitlines()


def scan_model(folder: Path) -> ModelFolder:
    """One model folder as it is now (its policy re-read from config.pbtxt; a config it cannot read is its error)."""
    try:
        versions = {v: d / MODEL_FILE for d in folder.iterdir() if (v := version_of(d.name))}
        files = {v: path for v, path in versions.items() if path.is_file()}
    except OSError as e:
        return ModelFolder(folder.name, folder, error=f"{folder}: cannot be listed: {e}")
    config = folder / CONFIG_FILE
    try:
        if not config.is_file() and os.path.lexists(config):  # Triton refuses the model; never opened (a pipe)
            raise ValueError("it is not a file (a folder, a link to nothing, a pipe): write the model's config there")
        policy = read_policy(config) if config.is_file() else VersionPolicy()
    except (OSError, ValueError) as e:
        return ModelFolder(folder.name, folder, files=files, error=f"{config}: {e}")
    return ModelFolder(folder.name, folder, policy, files)


def shown_name(name: str) -> str:
    """`name` as a log line or a JSON answer can carry it: the bytes of a name that is not UTF-8 as `\\xff` (as
    `vit-predict` writes them into Parquet), control characters and line separators as `\\n`, `\\x1b` or
    `\\u2028`; any other name as it is."""
    return "".join(ascii(c)[1:-1] if unicodedata.category(c) in LINE_BREAKING else c for c in parquet_text(name))


def scan(root: Path) -> dict[str, ModelFolder]:
    """Every model folder under `root` (a folder with a config.pbtxt or a version folder), by name.

    A model whose config cannot be read, or whose folder's name cannot name it (`shown_name`), is returned with
    its `error` set: it fails alone, not the scan.

    Raises:
        ValueError: `root` holds no model in this layout.
    """
    root = Path(root)
    models = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            has_version = any(d.is_dir() and version_of(d.name) for d in folder.iterdir())
        except OSError:
            has_version = True  # unreadable: scan_model says so as that model's error
        if not ((folder / CONFIG_FILE).is_file() or has_version):
            continue
        shown = shown_name(folder.name)  # the name itself, unless it cannot name the model
        if shown in models:  # a folder named `a\xff` in plain text, beside one whose name has the byte 0xff
            why = f"two folders of {root} read {shown} once written out (one not UTF-8, or with a control character)"
            why += ": rename that one"
            models[shown] = ModelFolder(shown, folder, error=why)
        elif shown != folder.name:
            why = "is not UTF-8 or holds a control character, which no URL, log line or metric can carry"
            models[shown] = ModelFolder(shown, folder, error=f"{root / shown}: the folder's name {why}: rename it")
        else:
            models[folder.name] = scan_model(folder)
    if not models:
        raise ValueError(
            f"{root} holds no model: expected <name>/<version>/{MODEL_FILE} (as vit-export --triton-repo writes)"
        )
    return models


def model_order(root: Path, default_model: str = "") -> list[str]:
    """The models of the folder `root`, `default_model` first when given, the others by name.

    Raises:
        ValueError: `root` holds no model (`scan`), or `default_model` is not one of them.
    """
    names = sorted(scan(root))
    if default_model and default_model not in names:
        raise ValueError(f"--default-model {default_model!r} is not in {root}; it holds {', '.join(names)}")
    return [default_model, *(n for n in names if n != default_model)] if default_model else names
