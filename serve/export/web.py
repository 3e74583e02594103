"""`vit-export --web DIR`: a static folder that classifies images in the browser, with no server.

    DIR/index.html, page.js, page.css   the page: drop an image, see the top-5 and the rollout overlay
    DIR/vitscope.js                     the module: `await window.vitscope.ready`, `await window.vitscope.classify(x)`
    DIR/model.onnx                      the portable target (standard ops, logits and attention maps out)
    DIR/ort/                            onnxruntime-web's WASM build, from npm (`serve/export/web_page/package.json`)

The page reads the class names, input size and preprocessing from the file's own metadata, so the folder
holds nothing the file does not already say. Any static host serves it; threads need the two
cross-origin isolation headers (see the guide, `docs/guide/browser.md`).

onnxruntime-web is not vendored: `make install` runs `npm ci` in `serve/export/web_page/`, and the files are
copied from its `node_modules`. Elsewhere, name an installed copy with `--ort-web DIR` or `VITSCOPE_ORT_WEB`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx

from serve.export import files
from serve.runtime.model_file import read_model_bytes

PAGE_DIR = Path(__file__).with_name("web_page")
PAGE_FILES = ("index.html", "page.css", "page.js", "vitscope.js")
# the WASM-only build: its ES module, the Emscripten glue it imports and the binary (SIMD, threads when isolated)
ORT_FILES = ("ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")


PACKAGING_OPTIONS = ("help", "web", "ort_web", "target")  # what `vit-export FILE.onnx --web DIR` applies


def options_not_applied(parser, args) -> list[str]:
    """The options given to `vit-export FILE.onnx --web DIR` that packaging an exported file cannot apply."""
    return [
        a.option_strings[0]
        for a in parser._actions
        if a.option_strings and a.dest not in PACKAGING_OPTIONS and getattr(args, a.dest) != a.default
    ]


def ort_web_version() -> str:
    """The onnxruntime-web version the page is built and tested with (pinned in web_page/package.json)."""
    return json.loads((PAGE_DIR / "package.json").read_text())["dependencies"]["onnxruntime-web"]


def install_hint() -> str:
    return f"run `npm ci --prefix {PAGE_DIR}` (make install does), or pass --ort-web with onnxruntime-web's dist folder"


def find_ort_dist(given: str | Path | None = None) -> Path:
    """onnxruntime-web's `dist` folder: `given`, else $VITSCOPE_ORT_WEB, else the one `npm ci` installs here.

    Raises:
        FileNotFoundError: the folder or one of its files is missing, with how to install it.
        ValueError: it holds another onnxruntime-web version than the pinned one.
    """
    env = os.environ.get("VITSCOPE_ORT_WEB")
    dist = Path(given or env or PAGE_DIR / "node_modules" / "onnxruntime-web" / "dist")
    missing = [f for f in ORT_FILES if not (dist / f).is_file()]
    if missing:
        names = ", ".join(missing)
        raise FileNotFoundError(f"onnxruntime-web's files are not in {dist} (missing {names}): {install_hint()}")
    package = dist.parent / "package.json"
    found = json.loads(package.read_text()).get("version") if package.is_file() else None
    if found is not None and found != ort_web_version():
        raise ValueError(
            f"{dist} holds onnxruntime-web {found}; the page is tested with {ort_web_version()}: {install_hint()}"
        )
    return dist


def check_web_model(model: onnx.ModelProto, name: str) -> None:
    """The page needs the portable target: standard ops (the WASM build has no onnxruntime contrib kernels for
    all of ours), `pixels` in, `logits` and `attns` out, and the vitscope metadata."""
    if any(o.domain == "com.microsoft" for o in model.opset_import):
        raise ValueError(f"{name} is the onnxruntime target (contrib ops); the browser needs --target portable")
    outputs = [o.name for o in model.graph.output]
    if "logits" not in outputs or "attns" not in outputs:
        raise ValueError(f"{name} outputs {outputs}; the page needs logits and attns: export it with --target portable")
    if not any(p.key == "vitscope_format" for p in model.metadata_props):
        raise ValueError(f"{name} has no vitscope metadata (class names, preprocessing): export it with vit-export")


def check_folder(folder: str | Path) -> None:
    """Refuse a `folder` that holds page files (`index.html`, ...) no earlier `--web` wrote: the user's own page.

    An earlier page is told by its `ort/NOTICE`, which every `--web` writes.
    """
    folder = Path(folder)
    notice = folder / "ort" / "NOTICE"
    if notice.is_file() and notice.read_bytes().startswith(b"onnxruntime-web "):
        return
    if theirs := [f for f in PAGE_FILES if (folder / f).exists()]:
        raise ValueError(
            f"--web {folder} holds {', '.join(theirs)}, which no vit-export --web wrote (there is no ort/NOTICE) and "
            "the page would replace: give --web a new or empty folder, or move them away"
        )


def write_web(model_path: str | Path, folder: str | Path, ort_dist: str | Path | None = None) -> Path:
    """Write the static page for the exported file `model_path` into `folder` and return `folder`.

    Files of an earlier page in `folder` are replaced, and page files of another are refused (`check_folder`);
    anything else there is left alone. Every file is staged
    before any is renamed into place, the model last (`serve.export.files.write_pieces`): a full disk or an error
    leaves the earlier page whole, and a folder being written never serves a half-copied file.
    """
    model_path, folder = Path(model_path), Path(folder)
    dist = find_ort_dist(ort_dist)
    check_folder(folder)
    try:  # as the server reads it: a folder, an empty, truncated or checkpoint file is said as such
        data = read_model_bytes(model_path)
    except OSError as e:  # not the page's write error (`vit-export`'s OSError)
        raise ValueError(f"cannot read {model_path}: {e.strerror or e}") from None
    try:
        model = onnx.load_model_from_string(data)
    except Exception as e:  # protobuf's DecodeError, and whatever a half-copied file makes it raise
        raise ValueError(f"{model_path} is not a readable ONNX file ({type(e).__name__}): export it again") from None
    check_web_model(model, str(model_path))
    notice = (
        f"onnxruntime-web {ort_web_version()} (https://www.npmjs.com/package/onnxruntime-web), "
        "Copyright (c) Microsoft Corporation, MIT License.\n"
    )
    pieces = {folder / "ort" / "NOTICE": notice.encode()}  # renamed first: a page stopped half-way is still ours
    pieces |= {folder / f: (PAGE_DIR / f).read_bytes() for f in PAGE_FILES}
    pieces |= {folder / "ort" / f: (dist / f).read_bytes() for f in ORT_FILES}
    if model_path.resolve() != (folder / "model.onnx").resolve():
        pieces[folder / "model.onnx"] = data
    (folder / "ort").mkdir(parents=True, exist_ok=True)
    files.remove_stale_temporaries(folder / "ort")
    files.write_pieces(pieces)
    return folder
