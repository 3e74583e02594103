"""`vit-export`: a trained checkpoint -> one self-describing ONNX file, checked against torch.

    vit-export runs/sample/checkpoints/best.ckpt -o artifacts/sample.onnx [--quantize int8]
        [--target onnxruntime|portable] [--opset 17..21] [--triton-repo DIR]
    vit-export runs/sample/checkpoints/best.ckpt --web site/      # a static page running it in the browser
    vit-export artifacts/portable.onnx --web site/               # the same page for a file exported before

The file holds, with no side files:
- the graph: (B, H, W, 3) uint8 pixels in (resized and cropped by `Preprocess.to_uint8`),
  normalisation inside, logits out. For the onnxruntime target (the default), an optional boolean
  `explain` input switches to the explain branch, which also outputs every block's attention maps
  (`serve.export.merge`), and the logits path's attention blocks and GELUs are onnxruntime contrib ops
  (`Attention`, `BiasGelu`: `serve.export.fusion`). The portable target is standard ONNX ops in one
  plain graph that always outputs logits and maps, for any runtime (`serve.export.targets`);
- `metadata_props`: class names, input size, preprocessing, patch grid, prefix tokens, depth,
  heads, variant, the checkpoint's sha256 and the versions used (see `build_metadata`), and the
  `calibration` entry (`serve.export.calibrate`): the temperature, prediction-set scores, the unknown-input
  threshold and the drift reference, fitted on the run's calibration split or on `--calibrate DIR`.

Before the file is written, the parity gate (`serve.export.parity`) runs torch and onnxruntime on
validation images and refuses the export when they disagree. `--triton-repo DIR` also writes a
Triton model repository with the logits-only graph (`serve.export.triton`). `--web DIR` writes a static
page that runs the portable target in the browser with onnxruntime-web (`serve.export.web`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx

from serve.export import calibrate as calib
from serve.export import files, preflight, targets, triton, web
from serve.export.merge import set_metadata
from serve.export.metadata import build_metadata
from serve.export.trace import DEFAULT_OPSET
from serve.runtime.image_files import path_argument
from serve.runtime.interrupts import exit_code, sigterm_as_interrupt
from serve.runtime.outputs import sync_folder
from vit.patch_embed import too_many_patches

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ExportResult:
    """What `export_onnx` wrote and measured."""

    path: Path
    metadata: dict[str, Any]
    parity: dict[str, Any] | None = None
    quantization: dict[str, Any] | None = None
    triton: Path | None = None
    calibration: dict[str, Any] | None = None
    reliability_png: Path | None = None


def export_onnx(
    checkpoint: str | Path,
    output: str | Path,
    *,
    quantize: str | None = None,
    opset: int = DEFAULT_OPSET,
    img_size: tuple[int, int] | None = None,
    val_dir: str | Path | None = None,
    parity_samples: int = 256,
    check_parity: bool = True,
    gradients: bool = True,
    target: str = "onnxruntime",
    triton_repo: str | Path | None = None,
    triton_name: str | None = None,
    calibrate: bool | None = None,
    calib_dir: str | Path | None = None,
    conformal: str = calib.DEFAULT_METHOD,
    class_conditional: bool = False,
    ood_score: str = calib.DEFAULT_OOD_SCORE,
) -> ExportResult:
    """Export a checkpoint to one ONNX file, check it against torch, and write it.

    Long because its options are documented here once (the CLI and the benchmarks call it); each step is a
    helper of this module or of `targets`, `calib`, `parity` and `triton`.

    Args:
        checkpoint: a vitscope checkpoint (`best.ckpt`).
        output: the .onnx file to write.
        quantize: None for fp32, or "int8" (dynamic, or static when calibration on the validation
            images is better); the onnxruntime target's explain branch stays fp32.
        opset: ONNX opset, in `serve.export.targets.OPSETS`.
        img_size: (H, W) to export at instead of the training size (multiples of the patch size).
        val_dir: an image folder (one subfolder per class) for the parity gate when the run has no split.json.
        parity_samples: at most this many validation images in the parity gate.
        check_parity: run the parity gate (only tests of the gate itself turn it off).
        gradients: include the gradient graph for class-specific gradient rollout (a larger
            file, `ls -l`; the logits path is unaffected). The onnxruntime target only.
        target: "onnxruntime" (fused contrib ops, explain branches behind an `If`) or "portable"
            (standard ONNX ops, logits and maps always computed); see `serve.export.targets`.
        triton_repo: also write a Triton model repository with the logits-only graph here.
        triton_name: the model's name in that repository (default: the output file's stem).
        calibrate: fit the `calibration` entry; None does when calibration images are found (and warns when
            not), True requires them, False writes an uncalibrated file.
        calib_dir: a labelled folder (DIR/<class>/<image>) to calibrate on instead of the run's calibration split.
        conformal: the prediction-set score, "lac" or "aps".
        class_conditional: one prediction-set threshold per class (for imbalanced folders).
        ood_score: the unknown-input score, "mahalanobis" (pre-logit features), "energy" or "max_softmax".

    Returns:
        An `ExportResult`.

    Raises:
        ParityError: torch and onnxruntime disagree beyond the thresholds; nothing is written.
        ValueError: bad arguments or a checkpoint that cannot be exported, refused before the export
            (`serve.export.preflight`), or an output folder that cannot be written.
    """
    from serve.export import parity

    checkpoint, output = Path(checkpoint), Path(output)
    preflight.check_output(checkpoint, output)
    preflight.check_parity_options(parity_samples, val_dir)
    preflight.check_image_folder("--calibrate", calib_dir)
    targets.check_opset(opset)
    if target not in targets.TARGETS:
        raise ValueError(f"target must be one of {', '.join(targets.TARGETS)}, got {target!r}")
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize must be None or 'int8', got {quantize!r}")
    name = triton.model_name(triton_name or output.stem) if triton_repo is not None else None
    net, meta = preflight.load_network(checkpoint)  # a wrong checkpoint path creates no output folder
    preflight.check_split(checkpoint, meta["class_names"])  # the gate's and the calibration's images
    if triton_repo is not None:
        triton.check_labels(meta["class_names"])  # labels.txt, refused now rather than after the export
        triton.check_model_folder(Path(triton_repo) / name)
        triton.check_output_apart(preflight.output_file(output), Path(triton_repo) / name)
    if calib_dir is not None and calibrate is not False:  # folders of other classes, too few images: refused now
        entries, _ = preflight.calibration_entries(checkpoint, meta["class_names"], calib_dir)
        preflight.check_decodable(entries, f"--calibrate {calib_dir}", preflight.MIN_IMAGES)
    with preflight.writable_folders(preflight.output_file(output), triton_repo):  # made now, gone if it stops
        preprocess = _serving_preprocess(net, meta["preprocess"], img_size)
        log.info("exporting %s at %s for %s, opset %d", checkpoint, preprocess.img_size, target, opset)
        sample = parity.validation_sample(checkpoint, meta["class_names"], preprocess, val_dir, parity_samples)
        graphs = targets.build(
            net,
            preprocess,
            target=target,
            opset=opset,
            sample=sample,
            quantize=quantize,
            gradients=gradients and target == "onnxruntime",
            logits_only=triton_repo is not None,
        )
        model = graphs.model
        supports_gradients = any(i.name == "target" for i in model.graph.input)
        metadata = build_metadata(
            net, meta, preprocess, opset, graphs.quantization, supports_gradients, graphs.fused, target=target
        )
        calibration, write_reports = calib.for_export(
            model, checkpoint, output, meta["class_names"], preprocess, calibrate, calib_dir,
            method=conformal, class_conditional=class_conditional, ood_kind=ood_score,
        )  # fmt: skip
        if calibration is not None:
            metadata[calib.METADATA_KEY] = calibration
        set_metadata(model, metadata)
        model.doc_string = f"vitscope {metadata['variant'] or 'ViT'} classifier, {len(meta['class_names'])} classes"
        onnx.checker.check_model(model)
        int8 = quantize == "int8"
        logits_only = graphs.logits_only
        if logits_only is not None:  # checked before anything is written
            triton.finish_model(logits_only, metadata, calibration, graphs.logits_only_quantization)
            if check_parity:
                parity.check_logits_only(net, logits_only.SerializeToString(), sample, preprocess, int8)

        def gate(path: Path) -> dict[str, Any] | None:
            int8_maps = int8 and target == "portable"
            return parity.check(net, path, sample, preprocess, int8, int8_maps=int8_maps) if check_parity else None

        folder = None
        with _write_checked(model, output, gate) as report:  # `output` comes last: once there, the export is whole
            if logits_only is not None:
                folder = triton.write_repo(logits_only, list(meta["class_names"]), triton_repo, name)
        png = write_reports()  # the model is in place: the run's reports now describe it
    return ExportResult(output, metadata, report, graphs.quant_report, folder, calibration, png)


def _serving_preprocess(net, preprocess, img_size):
    """The training preprocessing, at `img_size` when given (multiples of the patch size), of no more patches than a
    model runs (`--img-size 100000 100000` grew to 21 GB until the kernel killed the export)."""
    P = net.patch_embed.patch_size[0]
    if img_size is not None and (img_size[0] % P or img_size[1] % P):
        raise ValueError(f"--img-size {img_size} must be multiples of the patch size {P}")
    if why := too_many_patches(tuple(img_size or preprocess.img_size), P):
        given = "--img-size" if img_size is not None else "the checkpoint's image size"
        raise ValueError(f"{given}: {why}; export at a smaller --img-size")
    return preprocess if img_size is None else dataclasses.replace(preprocess, img_size=tuple(img_size))


@contextlib.contextmanager
def _write_checked(model: onnx.ModelProto, output: Path, gate: Any) -> Iterator[dict[str, Any] | None]:
    """Write `model` to a temporary file next to `output` and yield `gate(tmp)`; the file is moved into place
    when the block ends without an error (removed otherwise), whole (`serve.export.files`).
    A link is written through: the temporary goes beside the file it names, and the link stays."""
    target = preflight.output_file(output)
    target.parent.mkdir(parents=True, exist_ok=True)  # another export's failure may have removed it (`preflight`)
    files.remove_stale_temporaries(target.parent)
    tmp = target.with_name(files.temporary_name(target.name))
    try:
        files.write_new(tmp, model.SerializeToString())
        yield gate(tmp)
        os.replace(tmp, target)
        sync_folder(target.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _parser() -> argparse.ArgumentParser:
    opsets = targets.OPSETS
    oldest = ", ".join(f"{o}: {v}" for o, v in targets.OLDEST_ONNXRUNTIME.items())
    p = argparse.ArgumentParser(prog="vit-export", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "checkpoint",
        type=path_argument,
        help="a vitscope checkpoint, e.g. runs/sample/checkpoints/best.ckpt (or, with --web alone, a portable .onnx)",
    )
    p.add_argument("-o", "--output", type=path_argument, help="the .onnx file to write (--web: DIR/model.onnx)")
    p.add_argument(
        "--target",
        choices=targets.TARGETS,
        help="onnxruntime (the default): fused contrib ops, fastest on onnxruntime, explain branches behind optional "
        "inputs; portable (the default with --web): standard ONNX ops only (OpenVINO, onnx.reference, onnxruntime-web, "
        "any runtime), logits and attention maps always output, no gradient rollout",
    )
    p.add_argument(
        "--web",
        type=path_argument,
        metavar="DIR",
        help="also write a static page that classifies images in the browser (onnxruntime-web): DIR/index.html, ...",
    )
    p.add_argument(
        "--ort-web",
        type=path_argument,
        metavar="DIST",
        help="onnxruntime-web's dist folder for --web (default: the one `make install` puts in serve/export/web_page)",
    )
    p.add_argument("--quantize", choices=["int8"], default=None, help="int8 weights for the logits path")
    p.add_argument(
        "--opset",
        type=int,
        default=DEFAULT_OPSET,
        help=f"ONNX opset, {opsets[0]} to {opsets[-1]} (default {DEFAULT_OPSET}); the oldest onnxruntime that loads "
        f"the file, either target: {oldest}",
    )
    p.add_argument("--img-size", type=int, nargs=2, metavar=("H", "W"), help="export at another input size")
    p.add_argument("--val-dir", type=path_argument, help="images for the parity gate if the run has none it can read")
    p.add_argument(
        "--no-gradients", action="store_true", help="leave out the gradient graph (smaller file, no gradient rollout)"
    )
    p.add_argument("--parity-samples", type=int, default=256, help="validation images in the parity gate")
    p.add_argument(
        "--triton-repo",
        type=path_argument,
        metavar="DIR",
        help="also write a Triton model repository: DIR/NAME/config.pbtxt, labels.txt, 1/model.onnx (logits only)",
    )
    p.add_argument("--triton-name", help="the model's name in the Triton repository (default: the output's stem)")
    calib.add_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (`vit-export`)."""
    from serve.export.parity import ParityError, format_report

    parser = _parser()
    args = parser.parse_args(argv)
    if args.web is not None and args.target == "onnxruntime":
        parser.error("--web needs the portable target (the browser has no onnxruntime contrib ops): drop --target")
    if args.checkpoint.suffix == ".onnx" and args.web is not None:
        if unused := web.options_not_applied(parser, args):  # taken, and silently not applied
            parser.error(
                f"{args.checkpoint} is exported already, as --web packages it: {', '.join(unused)} would change nothing"
            )
        return _package_web(args.checkpoint, args.web, args.ort_web)  # a file exported before, for the browser
    if args.output is None and args.web is None:
        parser.error("name the file to write with -o, e.g. -o artifacts/model.onnx")
    calib.check_args(parser, args)
    if args.triton_name is not None and args.triton_repo is None:
        parser.error("--triton-name names the model in --triton-repo, which is not given: it would change nothing")
    if args.web is not None:
        try:
            web.find_ort_dist(args.ort_web)  # before a minute of export, not after
            web.check_folder(args.web)
        except (FileNotFoundError, ValueError) as e:
            print(f"vit-export: {e}", file=sys.stderr)
            return 2
    target = args.target or ("portable" if args.web is not None else "onnxruntime")
    output = args.output or args.web / "model.onnx"
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("serve").setLevel(logging.INFO)  # our progress; the exporter's own INFO chatter stays quiet
    try:
        with sigterm_as_interrupt():  # `timeout` or a pipeline's stop: the temporaries are removed, as on Ctrl-C
            result = _export(args, output, target)
    except KeyboardInterrupt as e:
        print(f"vit-export: {str(e) or 'interrupted'}: nothing was written (each file is written whole or not at all)",
              file=sys.stderr)  # fmt: skip
        return exit_code(e)
    except ParityError as e:
        if "images" in e.report:
            print(format_report(e.report), file=sys.stderr)
        print(f"vit-export: parity gate FAILED, nothing written: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:
        print(f"vit-export: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a disk that filled up or a folder that went away while writing
        print(
            f"vit-export: could not write the model: {e.strerror or e} ({e.filename or args.output})", file=sys.stderr
        )
        return 2
    _print_result(result, target, format_report)
    return 0 if args.web is None else _package_web(result.path, args.web, args.ort_web)


def _export(args: argparse.Namespace, output: Path, target: str) -> ExportResult:
    """`export_onnx` with the command line's options."""
    return export_onnx(
        args.checkpoint,
        output,
        quantize=args.quantize,
        opset=args.opset,
        img_size=tuple(args.img_size) if args.img_size else None,
        val_dir=args.val_dir,
        parity_samples=args.parity_samples,
        gradients=not args.no_gradients,
        target=target,
        triton_repo=args.triton_repo,
        triton_name=args.triton_name,
        calibrate=False if args.no_calibration else (True if args.calibrate else None),
        calib_dir=args.calibrate,
        conformal=args.conformal or calib.DEFAULT_METHOD,
        class_conditional=args.class_conditional,
        ood_score=args.ood_score or calib.DEFAULT_OOD_SCORE,
    )


def _print_result(result: ExportResult, target: str, format_report) -> None:
    print(format_report(result.parity, result.quantization))
    print(calib.format_report(result.calibration, result.metadata["class_names"]))
    if result.reliability_png is not None:
        print(f"wrote the reliability diagram {result.reliability_png}")
    size_mb = result.path.stat().st_size / 1e6
    print(f"wrote {result.path} ({size_mb:.1f} MB, {len(result.metadata['class_names'])} classes, {target})")
    if result.triton is not None:
        print(f"wrote the Triton model {result.triton} (config.pbtxt, labels.txt, 1/model.onnx)")


def _package_web(model: Path, folder: Path, ort_dist: Path | None) -> int:
    try:
        web.write_web(model, folder, ort_dist)
    except (ValueError, FileNotFoundError) as e:
        print(f"vit-export: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"vit-export: could not write the page: {e.strerror or e} ({e.filename or folder})", file=sys.stderr)
        return 2
    print(f"wrote the web page {folder}/ (index.html, model.onnx, onnxruntime-web {web.ort_web_version()})")
    print(
        f"  try it: python -m http.server 8000 --bind 127.0.0.1 --directory {folder}  # then open http://127.0.0.1:8000"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
