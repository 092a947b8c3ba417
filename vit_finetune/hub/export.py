"""`export`: a run folder as a Hub-ready model folder.

An exported folder holds timm's own format (config.json + model.safetensors: `timm.create_model(
"hf-hub:REPO", pretrained=True)` builds timm's model from it, and vitft's `create_model` its native
one), a model card (README.md, see card.py) and, when the run has them, the training curves and the
confusion matrix the card embeds; with `onnx`, a model.onnx checked against PyTorch (see onnx.py).
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from ..errors import VitftError
from ..run_folder import CARD_IMAGES, as_dict
from .card import adapter_card, hyperparameters, model_card
from .onnx import ONNX_FILES, export_onnx, require_onnx
from .run import PathLike, check_run

log = logging.getLogger("vitft")

# every file `export` writes: what --overwrite replaces in an existing folder (nothing else is touched)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # weights/adapters.py's, named without torch
MODEL_FILES = ("config.json", "model.safetensors")  # the merged model's
EXPORT_FILES = (*MODEL_FILES, "README.md", *CARD_IMAGES, *ONNX_FILES, *ADAPTER_FILES)
DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16", "half": "float16",
          "bf16": "bfloat16", "bfloat16": "bfloat16"}


def dtype_name(dtype: str) -> str:
    """The torch dtype name of an export precision (fp32, fp16, bf16 or a torch name); a VitftError when unknown."""
    name = DTYPES.get(str(dtype).lower())
    if name is None:
        raise VitftError(f"unknown dtype {dtype!r}; use fp32, fp16 or bf16")
    return name


def _small_vitft_info(info: dict) -> dict:
    """What the exported config keeps of the run's "vitft" key: the recipe and the best epoch, no paths."""
    small: dict[str, Any] = {}
    hyper = hyperparameters(info["train"])
    if hyper:
        small["train"] = hyper
    if info["best"]:
        small["best"] = {k: v for k, v in info["best"].items() if isinstance(v, (int, float, str))}
    return small


def _staging_dir(out: Path) -> Path:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as err:
        raise VitftError(f"cannot write to {out.parent}: {err}") from err


def _install(staging: Path, out: Path) -> None:
    """Move the finished export into place: a rename for a new folder, file by file over an old export.

    Over an old export every file is renamed over its old version (none is ever missing), config.json before
    model.safetensors as save_pretrained does, then the old export's files that the new one lacks are removed.
    """
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.replace(staging, out)
        return
    for name in EXPORT_FILES:
        if (staging / name).exists():
            os.replace(staging / name, out / name)
        else:
            (out / name).unlink(missing_ok=True)


def _check_img_size(config: dict, img_size: Optional[int]) -> None:
    """An --img-size must hold at least one patch (checked before anything is loaded)."""
    if img_size is None:
        return
    from ..models.archs import get_arch, split_name
    from ..models.pos_embed import to_int_pair

    patch = as_dict(config.get("model_args")).get("patch_size")
    if patch is None:
        try:
            patch = get_arch(split_name(str(config.get("architecture")))[0]).kwargs.get("patch_size", 1)
        except Exception:  # noqa: BLE001 - an unknown architecture is reported by load_model itself
            patch = 1
    patch = max(to_int_pair(patch))
    if img_size < patch:
        raise VitftError(f"--img-size {img_size} is smaller than the model's patch size {patch}; pass a multiple "
                         f"of {patch}")


def export(run_dir: PathLike, out_dir: PathLike, dtype: str = "fp32", *, overwrite: bool = False,
           repo_id: Optional[str] = None, dataset: Optional[str] = None, onnx: bool = False,
           img_size: Optional[int] = None, adapter: bool = False) -> Path:
    """Write the folder `push` uploads: timm-format config.json + model.safetensors, README.md, images.

    `dtype` (fp32, fp16, bf16) is the saved weights' precision; `repo_id` the repo the card's usage
    snippets name (a `<user>/<repo>` placeholder without it); `dataset` a Hub dataset id for the card's
    metadata. A non-empty `out_dir` is an error unless `overwrite`, which replaces only the files an
    export writes. Everything is written to a staging folder first: a new `out_dir` appears complete
    or not at all.

    `onnx` also writes model.onnx (float32 whatever `dtype`), checked against PyTorch with onnxruntime
    (see onnx.py); `img_size` exports everything (weights, config.json, model.onnx) at that input
    size, the position embedding resized.

    `adapter` writes a LoRA run's adapter alone (adapter_config.json + adapter_model.safetensors, as peft writes
    them) with a card whose snippet loads it with timm + peft.
    """
    if onnx:
        require_onnx()  # before any work
    run = check_run(run_dir)
    dtype = dtype_name(dtype)
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise VitftError(f"{out} exists and is not a folder")
    if out.resolve() in (run.path.resolve(), run.adapter_dir.resolve()):  # --overwrite would replace its files
        raise VitftError(f"export into a new folder, not into the run folder {run} itself or its "
                         f"{run.adapter_dir.name}/")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise VitftError(f"{out} already exists and is not empty; pass --overwrite to replace the exported files "
                         "in it, or pick another folder")
    if adapter and not all((run.adapter_dir / name).is_file() for name in ADAPTER_FILES):
        raise VitftError(f"{run} has no adapter ({run.adapter_dir.name}/{ADAPTER_FILES[0]}): only a run trained with "
                         "--lora has one; export without --adapter")
    replaced = [name for name in EXPORT_FILES if (out / name).exists()]
    if replaced and not any(all((out / name).is_file() for name in files) for files in (MODEL_FILES, ADAPTER_FILES)):
        # a folder without an earlier export (a project's root, a data folder): its README.md is the user's own
        raise VitftError(f"{out} holds {', '.join(replaced)} but no exported model (config.json + model.safetensors): "
                         "--overwrite only replaces an earlier export's files; pick another folder")
    if adapter:
        return _export_adapter(run, out, repo_id)
    import torch

    from ..files import plain_permissions
    from ..weights.loading import load_model
    from ..weights.saving import save_pretrained

    info = run.vitft_info()
    _check_img_size(info["config"], img_size)
    model = load_model(str(run), img_size=img_size)
    staging = _staging_dir(out)
    try:
        save_pretrained(model, staging, extra_config={"vitft": _small_vitft_info(info)} if info["train"] else None,
                        dtype=getattr(torch, dtype))
        images = run.card_images()
        for name in images:
            shutil.copyfile(run.path / name, staging / name)
        if onnx:
            export_onnx(model, staging)
        card = model_card(run, repo_id, model=model, dtype=dtype, dataset=dataset, images=images, onnx=onnx)
        (staging / "README.md").write_text(card, encoding="utf-8")
        plain_permissions(staging)
        _install(staging, out)
    except OSError as err:
        raise VitftError(f"cannot write the export to {out}: {err}") from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.debug("exported %s to %s (%s weights)", run, out, dtype)
    return out


def _export_adapter(run, out: Path, repo_id: Optional[str]) -> Path:
    """The adapter files as the run saved them, and the adapter's card."""
    import json

    from ..files import plain_permissions

    staging = _staging_dir(out)
    try:
        for name in ADAPTER_FILES:
            shutil.copyfile(run.adapter_dir / name, staging / name)
        config = json.loads((staging / ADAPTER_FILES[0]).read_text())
        (staging / "README.md").write_text(adapter_card(run, config, repo_id), encoding="utf-8")
        plain_permissions(staging)
        _install(staging, out)
    except (OSError, ValueError) as err:
        raise VitftError(f"cannot write the adapter export to {out}: {err}") from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
