"""Where the model looked: attention heat maps of a ViT's predictions.

Every method reads the attention weights that the native `Attention` hands to its `attn_hook` (models.layers), and then
reads the rows of the tokens the classifier pools: the class token's row for global_pool='token', the mean of the
pooled rows for average/max pooling (the patch rows, or every row with pool_include_prefix). Only the patch columns
make the map; prefix tokens (class, registers: `model.num_prefix_tokens` of them) are dropped.

- rollout (default): attention rollout (Abnar and Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020):
  per layer, the heads' mean attention plus the identity (the residual), rows renormalised, multiplied through the
  layers. Attention sinks are left out first (below).
- attention: the last block's attention, per head (`Explanation.head_maps`) and averaged.
- gradcam: gradient-weighted attention rollout for one class (Chefer, Gur and Wolf, "Generic Attention-model
  Explainability for Interpreting Bi-Modal and Encoder-Decoder Transformers", ICCV 2021, eqs. 5-6): per layer
  A_bar = mean over heads of (dlogit/dA * A) clamped at 0, and R <- R + A_bar @ R from R = I; the rows are read
  from R - I (what flowed through attention; with average pooling the identity would add a uniform 1/N). Sharper
  than rollout where rollout is diffuse, and specific to the class explained (the prediction, or `target`).

Attention sinks: a patch token that takes, on average over every row of a layer, more than `SINK_SHARE` of the
attention (and 8x the uniform share) is not something the model looked at for this image but a place every token
parks attention in (see `find_sinks`). Rollout multiplies it into every row and the map becomes one blob there. Such
columns are left out of their layer (rows renormalised) and the tokens' cells are 0 in the map;
`Explanation.left_out` lists them and the figure's title says so. Automatic for models without register tokens
(registers exist to take that role); `drop_sinks=False` (`--keep-sinks`) keeps the plain rollout.

The model sees the centre crop that `predict` uses; the map is pasted over that crop at the image's size, and is 0
where the model did not look at all (outside the crop).
"""
from __future__ import annotations

import html
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Optional, Union

import numpy as np
import torch

from ..data.images import load_rgb
from ..data.transforms import build_transforms
from ..errors import VitftError
from ..files import atomic_write, printable
from ..models.vit import VisionTransformer
from ..runtime import choose_precision, compute_context, model_widths
from ..weights.preprocessing import preprocessing
from .inference import ImagesLike, ModelLike, ProgressFn, is_multi_label, label_names, prepare_classifier
from .plots import explanation_figure, save_png

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger("vitft")

METHODS = ("rollout", "attention", "gradcam")
# Measured on DINOv2 ViT-S/14 (no registers), 48 Intel photos at 224 and 112 px: in block 0 one patch per image takes
# a median 13% (224 px: 34x uniform) and 16% (112 px: 10x) of every row's attention, over 10% in 35 and 40 of the 48
# images, while blocks 1-11's most attended patch takes a median 1-6%; no block output has a norm above 2.2x the
# median, so these are sinks, not the high-norm tokens of Darcet et al. 2024. With few tokens a tenth is no outlier
# (random tiny models reach 16% of 25 tokens): a sink also takes 8x the uniform share.
SINK_SHARE = 0.1
SINK_TIMES_UNIFORM = 8.0


def check_method(method: str) -> None:
    """The one check of an explain method's name (explain, attention_maps, evaluate's heat maps)."""
    if method not in METHODS:
        raise VitftError(f"unknown explain method {method!r}; use one of {', '.join(METHODS)} (--method)")


@dataclass
class Explanation:
    """One image's prediction and heat map. `error` says why the file could not be read (everything else empty)."""

    path: str
    labels: list[str]  # top-k, most probable first
    probs: list[float]
    method: str
    target: Optional[str] = None  # the class gradcam explains (rollout and attention do not depend on the class)
    heatmap: Optional[np.ndarray] = None  # (H, W) float32 in [0, 1] at the image's size; 0 outside the crop seen
    grid: Optional[np.ndarray] = None  # (grid_h, grid_w) float32: the relevance of each patch, unnormalised
    head_maps: Optional[np.ndarray] = None  # (heads, grid_h, grid_w): per-head maps of method 'attention'
    left_out: list[tuple[int, int]] = field(default_factory=list)  # (row, col) of attention sinks left out (rollout)
    figure: Optional[Path] = None  # the PNG written (with `output`)
    error: Optional[str] = None


# ----------------------------------------------------------------------------- attention maps


@contextmanager
def capture_attention(model: VisionTransformer, keep: Callable[[torch.Tensor], torch.Tensor]
                      ) -> Iterator[list[torch.Tensor]]:
    """A list that receives `keep(attention)` of every block, in order, for each forward pass run in the block.

    Grad checkpointing is off meanwhile (a recomputed forward would report its attention twice).
    """
    layers = [block.attn for block in model.blocks]
    if any(layer.attn_hook is not None for layer in layers):
        raise VitftError("the model's attention is already being captured (explain is not reentrant)")
    kept: list[torch.Tensor] = []
    checkpointing = model.grad_checkpointing
    model.grad_checkpointing = False
    for layer in layers:
        layer.attn_hook = lambda attn: kept.append(keep(attn))
    try:
        yield kept
    finally:
        for layer in layers:
            layer.attn_hook = None
        model.grad_checkpointing = checkpointing


def _readout(matrix: torch.Tensor, model: VisionTransformer) -> torch.Tensor:
    """(..., N, N) -> (..., N): the row of what the classifier pools (class token, or the mean of pooled rows)."""
    if model.global_pool == "token":
        return matrix[..., 0, :]
    start = 0 if model.pool_include_prefix else model.num_prefix_tokens
    return matrix[..., start:, :].mean(dim=-2)


def _check_pooling(model: VisionTransformer) -> None:
    if not model.global_pool:
        raise VitftError("the model has no pooling (global_pool=''): it is not an image classifier to explain")
    if model.global_pool == "map":
        log.warning("the model pools with attention ('map'): its pooling attention is not captured; the maps "
                    "read the mean of the patch rows instead")


class Maps(NamedTuple):
    """One batch's maps: logits (B, K), grids (B, gh, gw), per-head grids (B, heads, gh, gw) or None, targets (B,),
    and per image the (row, col) of the sinks rollout left out."""

    logits: torch.Tensor
    grids: torch.Tensor
    head_grids: Optional[torch.Tensor]
    targets: torch.Tensor
    left_out: list[list[tuple[int, int]]]


def attention_maps(model: VisionTransformer, x: torch.Tensor, method: str, target: Optional[int] = None,
                   drop_sinks: Optional[bool] = None) -> Maps:
    """The maps of a batch. `x` is the preprocessed batch; the model must be in eval mode. `target`: the class index
    gradcam explains (default: each image's prediction). `drop_sinks`: leave attention sinks out of rollout
    (default: when the model has no register tokens).
    """
    check_method(method)
    if drop_sinks is None:
        drop_sinks = not model.num_reg_tokens
    prefix = model.num_prefix_tokens
    ph, pw = model.patch_embed.patch_size
    grid_h, grid_w = x.shape[-2] // ph, x.shape[-1] // pw
    keep = {"rollout": lambda a: a.float().mean(dim=1),  # only the heads' mean is needed: B x N x N per layer
            "attention": lambda a: _readout(a.float(), model),  # B x heads x N per layer
            "gradcam": lambda a: a}[method]  # the tensor in the graph, for its gradient
    with capture_attention(model, keep) as kept, torch.enable_grad() if method == "gradcam" else torch.no_grad():
        if method == "gradcam":
            x = x.detach().requires_grad_(True)  # puts the attention in the graph even if every weight is frozen
        logits = model(x)
        targets = logits.argmax(dim=1) if target is None else torch.full_like(logits[:, 0], target, dtype=torch.long)
        heads = None
        sinks = torch.zeros(x.shape[0], prefix + grid_h * grid_w, dtype=torch.bool, device=x.device)
        if method == "rollout":
            if drop_sinks:
                kept, sinks = _without_sinks(kept, prefix)
            rows = _readout(_rollout(kept), model).masked_fill(sinks, 0.0)
        elif method == "attention":
            heads = kept[-1]
            rows = heads.mean(dim=1)
        else:
            score = logits.gather(1, targets[:, None]).sum()  # images are independent in eval: one backward
            grads = torch.autograd.grad(score, kept)
            relevance = _gradient_rollout(kept, grads)
            rows = _readout(relevance - torch.eye(relevance.shape[-1], device=relevance.device), model)
    if rows.shape[-1] != prefix + grid_h * grid_w:
        raise VitftError(f"the model returned {rows.shape[-1]} tokens for a {grid_h}x{grid_w} patch grid and "
                         f"{prefix} prefix tokens; cannot map them to the image")

    def to_grid(r: torch.Tensor) -> torch.Tensor:
        return r[..., prefix:].reshape(*r.shape[:-1], grid_h, grid_w).detach().float()  # bf16 under autocast

    left_out = [[divmod(int(t) - prefix, grid_w) for t in row.nonzero()] for row in sinks.cpu()]
    return Maps(logits.detach().float(), to_grid(rows), None if heads is None else to_grid(heads), targets, left_out)


def find_sinks(head_mean: torch.Tensor, prefix: int) -> torch.Tensor:
    """(B, N) bool: the patch tokens that take more than SINK_SHARE and SINK_TIMES_UNIFORM / N of a layer's
    attention, averaged over its rows."""
    sinks = head_mean.mean(dim=-2) > max(SINK_SHARE, SINK_TIMES_UNIFORM / head_mean.shape[-1])
    sinks[:, :prefix] = False  # the class token gathers by design; registers are where sinks belong
    return sinks


def _without_sinks(head_means: list[torch.Tensor], prefix: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each layer with its sinks' columns zeroed and rows renormalised, and (B, N) bool: a sink in any layer."""
    kept, anywhere = [], None
    for attn in head_means:
        sinks = find_sinks(attn, prefix)
        if sinks.any():  # else as it was, bit for bit
            attn = attn.masked_fill(sinks[:, None, :], 0.0)
            attn = attn / attn.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(attn.dtype).tiny)
        kept.append(attn)
        anywhere = sinks if anywhere is None else anywhere | sinks
    return kept, anywhere


def _rollout(head_means: list[torch.Tensor]) -> torch.Tensor:
    """Abnar and Zuidema's rollout: prod over layers (last on the left) of row-normalised (A + I)."""
    eye = torch.eye(head_means[0].shape[-1], device=head_means[0].device)
    rollout = None
    for attn in head_means:
        a = attn + eye
        a = a / a.sum(dim=-1, keepdim=True)
        rollout = a if rollout is None else a @ rollout
    return rollout


def _gradient_rollout(attns: Iterable[torch.Tensor], grads: Iterable[torch.Tensor]) -> torch.Tensor:
    """Chefer et al. 2021: R = I; per layer R += mean_heads((grad * attn)^+) @ R."""
    relevance = None
    for attn, grad in zip(attns, grads):
        cam = (grad.float() * attn.float()).clamp(min=0).mean(dim=1)
        if relevance is None:
            relevance = torch.eye(cam.shape[-1], device=cam.device).expand_as(cam)
        relevance = relevance + cam @ relevance
    return relevance


# ----------------------------------------------------------------------------- images


def crop_box(image_hw: tuple[int, int], model_hw: tuple[int, int], crop_pct: float) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) in image pixels of the centre crop that eval preprocessing shows the model.

    Mirrors data.transforms.build_transforms(train=False): shorter side to size / crop_pct (a non-square size:
    both sides), then a centre crop of the model's size.
    """
    H, W = image_hw
    h, w = model_hw
    sh, sw = int(h / crop_pct), int(w / crop_pct)
    if h == w:
        scale_y = scale_x = sh / min(H, W)
        rh, rw = round(H * scale_y), round(W * scale_x)
    else:
        scale_y, scale_x, rh, rw = sh / H, sw / W, sh, sw
    top, left = (rh - h) // 2, (rw - w) // 2
    box = (top / scale_y, left / scale_x, (top + h) / scale_y, (left + w) / scale_x)
    y0, x0, y1, x1 = (round(v) for v in box)
    return max(0, y0), max(0, x0), min(H, max(y1, y0 + 1)), min(W, max(x1, x0 + 1))


def heatmap_at_image_size(grid: np.ndarray, image_hw: tuple[int, int], model_hw: tuple[int, int],
                          crop_pct: float) -> np.ndarray:
    """The patch grid, min-max scaled to [0, 1], bilinearly upsampled over the crop the model saw, 0 elsewhere."""
    import cv2

    grid = np.asarray(grid, dtype=np.float32)
    span = float(grid.max() - grid.min())
    scaled = (grid - grid.min()) / span if span > 0 else np.zeros_like(grid)
    top, left, bottom, right = crop_box(image_hw, model_hw, crop_pct)
    out = np.zeros(image_hw, dtype=np.float32)
    out[top:bottom, left:right] = cv2.resize(scaled, (right - left, bottom - top), interpolation=cv2.INTER_LINEAR)
    return np.clip(out, 0.0, 1.0, out=out)


def _figure_name(index: int, path: str) -> str:
    stem = re.sub(r"[^\w.-]+", "-", Path(path).stem).strip("-") or "image"
    return f"{index:04d}-{stem[:60]}.png"


def _figure(image: np.ndarray, result: Explanation) -> Figure:
    """The image, the image with its heat map, the top labels underneath."""
    title = result.method + (f" for {result.target}" if result.target else "")
    if result.left_out:
        title += f" ({len(result.left_out)} attention sink(s) left out)"
    return explanation_figure(image, result.heatmap, Path(result.path).name, title, result.labels, result.probs)


def _write_index(results: list[Explanation], folder: Path, title: str) -> Path:
    cells = []
    for r in results:
        caption = html.escape(printable(r.path))
        if r.error is not None:
            cells.append(f'<figure class="error"><figcaption>{caption}<br>could not be read: '
                         f'{html.escape(printable(r.error))}</figcaption></figure>')
            continue
        labels = "<br>".join(f"{html.escape(printable(label))} {100 * p:.1f}%"
                             for label, p in zip(r.labels, r.probs))
        src = html.escape(r.figure.name, quote=True)
        cells.append(f'<figure><a href="{src}"><img src="{src}" loading="lazy"></a>'
                     f'<figcaption>{caption}<br>{labels}</figcaption></figure>')
    title = html.escape(printable(title))
    page = (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title><style>"
            "body{font-family:sans-serif;margin:1em}main{display:flex;flex-wrap:wrap;gap:1em}"
            "figure{margin:0;width:420px}img{width:100%}figcaption{font-size:13px;word-break:break-all}"
            ".error{color:#a00}</style></head>\n"
            f"<body><h1>{title}</h1><main>\n" + "\n".join(cells) + "\n</main></body></html>\n")
    index = folder / "index.html"
    atomic_write(index, lambda tmp: tmp.write_text(page, encoding="utf-8"))
    return index


# ----------------------------------------------------------------------------- explain


def explain(
    model: ModelLike,
    images: ImagesLike,
    method: str = "rollout",
    target: Optional[str] = None,
    output: Union[str, os.PathLike, None] = None,
    top_k: int = 3,
    img_size: Optional[int] = None,
    batch_size: int = 16,
    device: str = "auto",
    precision: str = "auto",
    arch: Optional[str] = None,
    progress: Optional[ProgressFn] = None,
    pretrained: bool = False,
    drop_sinks: Optional[bool] = None,
) -> list[Explanation]:
    """Heat maps of where the model looked, one Explanation per image, in sorted path order.

    `model` and `images` as `predict` takes them. `method`: rollout, attention or gradcam (see the module
    docstring); `target`: the label gradcam explains (default: each image's prediction). With `output`, each image
    gets a PNG there (the image, its heat map, the top-k labels) and index.html shows them all. Files that cannot be
    read give an Explanation with `error` set. `drop_sinks`: leave attention sinks out of rollout (module docstring;
    default: when the model has no register tokens).
    """
    check_method(method)
    dev, paths, net = prepare_classifier(model, images, arch, pretrained, img_size, top_k, batch_size, device,
                                         precision, "explain")
    precision = choose_precision(dev, precision, model_widths(net)).precision
    _check_pooling(net)
    classes = label_names(net)
    target_index = None
    if target is not None:
        if method != "gradcam":
            raise VitftError(f"--target applies to --method gradcam; {method} does not depend on the class")
        if target not in classes:
            raise VitftError(f"--target {target!r} is not one of the model's classes: {', '.join(classes[:20])}")
        target_index = classes.index(target)
    folder = Path(output).expanduser() if output is not None else None
    size = tuple(net.patch_embed.img_size)
    crop_pct = preprocessing(net.pretrained_cfg).crop_pct
    transform = build_transforms(net.pretrained_cfg, size, train=False)
    k = min(top_k, len(classes))
    results: list[Explanation] = []
    was_training = net.training
    net.to(dev).eval()
    try:
        for start in range(0, len(paths), batch_size):
            loaded, batch = [], []
            for path in paths[start:start + batch_size]:
                try:
                    image = load_rgb(path)
                except Exception as e:  # noqa: BLE001 - any decoding failure makes an error row, as in predict
                    log.warning("could not read %s: %s", path, e)
                    results.append(Explanation(str(path), [], [], method, error=f"{type(e).__name__}: {e}"))
                    continue
                loaded.append((path, image))
                batch.append(transform(image=image)["image"])
            if batch:
                x = torch.stack(batch).to(dev)
                with compute_context(dev, precision):
                    logits, grids, head_grids, targets, left_out = attention_maps(net, x, method, target_index,
                                                                                  drop_sinks)
                # a multi-label model's classes are each their own sigmoid, not shares of one softmax
                scores = logits.sigmoid() if is_multi_label(net) else logits.softmax(dim=1)
                probs, top = scores.topk(k, dim=1)
                for i, (path, image) in enumerate(loaded):
                    grid = grids[i].cpu().numpy()
                    result = Explanation(
                        str(path), [classes[c] for c in top[i].tolist()], [round(p, 6) for p in probs[i].tolist()],
                        method, target=classes[int(targets[i])] if method == "gradcam" else None,
                        heatmap=heatmap_at_image_size(grid, image.shape[:2], size, crop_pct), grid=grid,
                        head_maps=None if head_grids is None else head_grids[i].cpu().numpy(), left_out=left_out[i])
                    if folder is not None:
                        result.figure = folder / _figure_name(start + i, result.path)
                        save_png(_figure(image, result), result.figure)
                    results.append(result)
            if progress:
                progress(min(start + batch_size, len(paths)), len(paths))
    finally:
        net.train(was_training)
    position = {str(path): i for i, path in enumerate(paths)}
    results.sort(key=lambda r: position[r.path])  # unreadable files were appended ahead of their batch
    with_sinks = sum(bool(r.left_out) for r in results)
    if with_sinks:
        log.info("rollout: left out attention sinks (patches taking over %.0f%% of a layer's attention) in %d of %d "
                 "image(s); drop_sinks=False (--keep-sinks) keeps them", 100 * SINK_SHARE, with_sinks, len(results))
    if folder is not None:
        _write_index(results, folder, f"vitft explain: {method}")
    return results
