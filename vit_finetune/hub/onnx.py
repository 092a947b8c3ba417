"""ONNX export that is proven equal: write model.onnx, run it with onnxruntime, compare with PyTorch.

The graph comes from PyTorch's torch.export-based exporter (`torch.onnx.export(..., dynamo=True)`, the
default since torch 2.9; the TorchScript one is deprecated). It takes `pixel_values` (N, 3, H, W) at the
model's input size, normalised as config.json says, with a dynamic batch axis, and gives `logits` (N,
classes), always in float32. Before the file gets its final name, onnxruntime runs it on random batches of
several sizes and the largest absolute logit difference from the PyTorch model must be at most
`TOLERANCE`: an export that fails the check raises and leaves no file behind.
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

from ..errors import VitftError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vitft")

ONNX_FILE = "model.onnx"
ONNX_DATA_FILE = ONNX_FILE + ".data"  # the exporter's external weights file
ONNX_FILES = (ONNX_FILE, ONNX_DATA_FILE)
OPSET = 18
INPUT_NAME, OUTPUT_NAME, BATCH_AXIS = "pixel_values", "logits", "batch"
CHECK_BATCH_SIZES = (1, 3, 8)
TOLERANCE = 1e-4  # the largest absolute logit difference from PyTorch (fp32) that passes
# vitft is not on PyPI: the extra installs from a clone
INSTALL = "pip install -e '.[onnx]' in a clone of vitft, else pip install onnx onnxruntime onnxscript"
_PACKAGES = ("onnx", "onnxruntime", "onnxscript")  # onnxscript: the torch.export-based exporter needs it


@dataclass(frozen=True)
class OnnxCheck:
    """What the verification found: the file, the worst logit difference and the batch sizes run."""

    path: Path
    max_abs_diff: float
    batch_sizes: tuple[int, ...]
    opset: int = OPSET


def require_onnx() -> None:
    """Fail early, before any work, when the optional `onnx` extra is not installed."""
    missing = []
    for name in _PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise VitftError(f"ONNX export needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                         f"not installed; install them with: {INSTALL}")


def _cpu_fp32(model: torch.nn.Module) -> torch.nn.Module:
    """The model as the exporter needs it: on the CPU, in float32 (a copy only when it is not already)."""
    import torch

    if all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters()):
        return model
    return copy.deepcopy(model).to("cpu", torch.float32)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Mute the exporter's warnings and its graph passes' INFO logs (one line per deduplicated weight)."""
    loggers = [logging.getLogger(name) for name in ("onnx_ir", "onnxscript", "torch.onnx")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _write_onnx(model: torch.nn.Module, path: Path, example: torch.Tensor) -> None:
    """Trace `model` with torch.export and save the ONNX graph (weights inline below 2 GB)."""
    import torch

    batch = torch.export.Dim(BATCH_AXIS, min=1)
    try:
        with _quiet_exporter():
            program = torch.onnx.export(
                model, (example,), None, dynamo=True, input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                opset_version=OPSET, dynamic_shapes=({0: batch},), verbose=False)
            program.save(str(path))
    except Exception as err:  # noqa: BLE001 - any exporter failure means the same thing to the user
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise VitftError(f"the ONNX exporter failed ({type(err).__name__}: {first[:300]})") from err


def max_logit_difference(model: torch.nn.Module, path: Path, batch_sizes: Sequence[int] = CHECK_BATCH_SIZES,
                         seed: int = 0) -> float:
    """The largest |onnxruntime - PyTorch| logit over random normal batches of each size (inf on NaN)."""
    import numpy as np
    import onnxruntime as ort
    import torch

    # the model's bytes, not its path: onnxruntime takes UTF-8 paths only (a run folder's name may have other bytes)
    session = ort.InferenceSession(Path(path).read_bytes(), providers=["CPUExecutionProvider"])
    channels, (h, w) = model.patch_embed.proj.in_channels, model.patch_embed.img_size
    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    for size in batch_sizes:
        x = torch.randn(size, channels, h, w, generator=generator)
        with torch.no_grad():
            expected = model(x).numpy()
        (got,) = session.run([OUTPUT_NAME], {INPUT_NAME: x.numpy()})
        if got.shape != expected.shape:
            raise VitftError(f"the ONNX model gives logits of shape {got.shape} for a batch of {size}, "
                             f"PyTorch {expected.shape}")
        diff = float(np.abs(got - expected).max())
        worst = max(worst, diff if np.isfinite(diff) else float("inf"))
    return worst


def export_onnx(model: torch.nn.Module, folder: os.PathLike | str, *, tolerance: Optional[float] = None,
                batch_sizes: Sequence[int] = CHECK_BATCH_SIZES) -> OnnxCheck:
    """Write `folder`/model.onnx from `model` (a native ViT), verified against PyTorch first.

    The graph is exported and checked in a temporary folder beside the target and only then renamed
    into place, so `folder` never holds an unverified or half-written model.onnx. `tolerance`
    defaults to TOLERANCE. The model is left as it was (mode, device, dtype).
    """
    import torch

    require_onnx()
    tolerance = TOLERANCE if tolerance is None else tolerance
    folder = Path(folder)
    reference = _cpu_fp32(model)
    was_training = reference.training
    reference.eval()
    channels, (h, w) = reference.patch_embed.proj.in_channels, reference.patch_embed.img_size
    example = torch.randn(2, channels, h, w, generator=torch.Generator().manual_seed(1))  # 2: keeps the batch axis free
    try:
        folder.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".onnx-", suffix=".tmp", dir=folder))
    except OSError as err:
        raise VitftError(f"cannot write to {folder}: {err}") from err
    try:
        _write_onnx(reference, work / ONNX_FILE, example)
        diff = max_logit_difference(reference, work / ONNX_FILE, batch_sizes)
        sizes = ", ".join(map(str, batch_sizes))
        if not diff <= tolerance:
            raise VitftError(f"the ONNX model does not match PyTorch: max |logit difference| {diff:.3g} over "
                             f"batches of {sizes} exceeds {tolerance:g}; {ONNX_FILE} was not written")
        log.info("%s (opset %d, float32, %dx%d input, dynamic batch) matches PyTorch: max |logit difference| "
                 "%.2e over random batches of %s (limit %g)", ONNX_FILE, OPSET, h, w, diff, sizes, tolerance)
        has_data = (work / ONNX_DATA_FILE).exists()  # external weights: only for models over 2 GB
        if has_data:
            os.replace(work / ONNX_DATA_FILE, folder / ONNX_DATA_FILE)
        os.replace(work / ONNX_FILE, folder / ONNX_FILE)  # last: model.onnx appears complete
        if not has_data:
            (folder / ONNX_DATA_FILE).unlink(missing_ok=True)  # an older, larger export's weights
    except OSError as err:
        raise VitftError(f"cannot write {folder / ONNX_FILE}: {err}") from err
    finally:
        reference.train(was_training)
        shutil.rmtree(work, ignore_errors=True)
    return OnnxCheck(folder / ONNX_FILE, diff, tuple(batch_sizes))


_PIL_FILTERS = {"bicubic": "BICUBIC", "bilinear": "BILINEAR", "nearest": "NEAREST", "lanczos": "LANCZOS",
                "box": "BOX", "hamming": "HAMMING"}


def onnx_usage(repo: str, pretrained_cfg: dict, img_size: Sequence[int], top_k: int) -> list[str]:
    """The model card's onnxruntime section: the file's contract and a snippet with the preprocessing.

    The snippet's preprocessing is timm's eval transform written with PIL and numpy only (short side
    resized to size / crop_pct, centre crop, scale to [0, 1], normalise), so it needs neither torch nor timm.
    """
    from ..weights.preprocessing import preprocessing

    h, w = img_size
    pre = preprocessing(pretrained_cfg)
    crop_pct, mean, std, interpolation = pre.crop_pct, list(pre.mean), list(pre.std), pre.interpolation
    pil_filter = _PIL_FILTERS.get(interpolation, "BICUBIC")
    scale_h, scale_w = int(h / crop_pct), int(w / crop_pct)
    if h == w:
        what = f"resize the short side to {scale_h}, centre-crop {h} x {w}"
        resize = ["    width, height = image.size",
                  f"    short = {scale_h}",
                  "    size = (short, int(short * height / width)) if width <= height else "
                  "(int(short * width / height), short)"]
    else:
        what = f"resize to {scale_h} x {scale_w}, centre-crop {h} x {w}"
        resize = [f"    size = ({scale_w}, {scale_h})"]
    return [
        "### ONNX Runtime\n",
        f"`{ONNX_FILE}` (float32, opset {OPSET}) takes `{INPUT_NAME}`, a float32 batch of shape (N, 3, {h}, {w}) "
        f"normalised as below, and returns `{OUTPUT_NAME}` (N, classes); the batch size N is free, the image size "
        f"is fixed at {h} x {w}. On export vitft ran it with onnxruntime and checked its logits against PyTorch's "
        f"(largest difference at most {TOLERANCE:g}).\n",
        "```python", "import json", "", "import numpy as np", "import onnxruntime as ort",
        "from huggingface_hub import hf_hub_download", "from PIL import Image", "",
        f'session = ort.InferenceSession(hf_hub_download("{repo}", "{ONNX_FILE}"))',
        f'with open(hf_hub_download("{repo}", "config.json")) as f:',
        '    labels = json.load(f).get("label_names")', "", "",
        "def preprocess(image: Image.Image) -> np.ndarray:",
        f'    """timm\'s eval transform: {what}, normalise; (1, 3, {h}, {w}) float32."""',
        '    image = image.convert("RGB")', *resize,
        f"    image = image.resize(size, Image.Resampling.{pil_filter})",
        "    left, top = round((size[0] - " + str(w) + ") / 2), round((size[1] - " + str(h) + ") / 2)",
        f"    image = image.crop((left, top, left + {w}, top + {h}))",
        "    x = np.asarray(image, dtype=np.float32) / 255",
        f"    x = (x - np.array({mean}, dtype=np.float32)) / np.array({std}, dtype=np.float32)",
        "    return x.transpose(2, 0, 1)[None]", "", "",
        f'logits = session.run(["{OUTPUT_NAME}"], {{"{INPUT_NAME}": preprocess(Image.open("image.jpg"))}})[0]',
        *(_multi_label_lines(repo) if pretrained_cfg.get("multi_label") else [
            "probs = np.exp(logits - logits.max(axis=-1, keepdims=True))",
            "probs /= probs.sum(axis=-1, keepdims=True)",
            f"for i in np.argsort(-probs[0])[:{top_k}]:",
            '    print(f"{labels[i] if labels else i}: {probs[0, i]:.3f}")']), "```", ""]


def _multi_label_lines(repo: str) -> list[str]:
    """A multi-label model's last snippet lines: a sigmoid per class, the labels over their thresholds."""
    return ["probs = 1 / (1 + np.exp(-logits))  # multi-label: a sigmoid per class",
            f'with open(hf_hub_download("{repo}", "config.json")) as f:',
            '    thresholds = json.load(f)["thresholds"]',
            "for i in np.argsort(-probs[0]):",
            "    if probs[0, i] >= thresholds[i]:",
            '        print(f"{labels[i] if labels else i}: {probs[0, i]:.3f}")']
