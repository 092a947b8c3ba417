"""Facts about the ONNX export: model.onnx gives PyTorch's logits (to 1e-4) through onnxruntime, for any batch
size; its interface is pixel_values -> logits with a dynamic batch axis; --img-size exports at a new resolution;
a failed check leaves no file; a missing `onnx` extra fails early and names the install command.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="the ONNX export tests need the onnx extra: pip install -e '.[onnx]'")
pytest.importorskip("onnxscript", reason="the ONNX export tests need the onnx extra: pip install -e '.[onnx]'")
onnx = pytest.importorskip("onnx", reason="the ONNX export tests need the onnx extra: pip install -e '.[onnx]'")
import onnxruntime as ort  # noqa: E402
from conftest import CLASSES, NOT_UTF8, TINY, tiny_classifier  # noqa: E402

import vit_finetune.hub.onnx as onnx_export  # noqa: E402
from vit_finetune import create_model, export, load_model  # noqa: E402
from vit_finetune.errors import VitftError  # noqa: E402
from vit_finetune.hub.onnx import export_onnx  # noqa: E402

VARIANTS = {
    "class_token": {},
    "avg_pool_registers": dict(global_pool="avg", class_token=False, reg_tokens=4),
    "layerscale_qknorm_rmsnorm_swiglu": dict(init_values=1e-5, qk_norm=True, norm_layer="rmsnorm",
                                             mlp_layer="swiglu"),
}
DIFF_LINE = re.compile(r"max \|logit difference\| ([0-9.e+-]+) over random batches of 1, 3, 8")


def onnx_logits(path: Path, x: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"pixel_values": x.numpy()})[0]


def torch_logits(model, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(x).numpy()


def io_shapes(path: Path) -> dict:
    """{name: [dim_param or dim_value, ...]} of the graph's inputs and outputs, plus element types."""
    graph = onnx.load(str(path), load_external_data=False).graph
    return {v.name: ([d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim], v.type.tensor_type.elem_type)
            for v in (*graph.input, *graph.output)}


def vitft(*args: str, block: str = "") -> subprocess.CompletedProcess:
    """`vitft ARGS` in a fresh interpreter; `block` names a module made unimportable first."""
    code = (f"import sys; sys.modules[{block!r}] = None\n" if block else "") + \
        "from vit_finetune.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def cli_export(tiny_model_dir, tmp_path_factory) -> dict:
    """`vitft export RUN OUT --onnx --dtype fp16` on a folder written by save_pretrained."""
    out = tmp_path_factory.mktemp("cli") / "export"
    proc = vitft("export", str(tiny_model_dir), str(out), "--onnx", "--dtype", "fp16")
    return {"proc": proc, "out": out}


# ---- the round trip ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_onnx_round_trip_matches_pytorch(variant, tmp_path):
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16_224", num_classes=len(CLASSES), **TINY, **VARIANTS[variant])
    model.train()  # the export runs in eval mode and gives the model back as it was
    check = export_onnx(model, tmp_path)
    assert model.training
    assert check.path == tmp_path / "model.onnx" and check.max_abs_diff <= 1e-4 and check.batch_sizes == (1, 3, 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # no temporary files, no external data

    generator = torch.Generator().manual_seed(7)
    for batch in (1, 5):  # the test's own batches, not the ones the export checked
        x = torch.randn(batch, 3, 32, 32, generator=generator)
        got, expected = onnx_logits(check.path, x), torch_logits(model, x)
        assert got.shape == (batch, len(CLASSES))
        assert np.abs(got - expected).max() <= 1e-4

    shapes = io_shapes(check.path)
    float32 = onnx.TensorProto.FLOAT
    assert list(shapes) == ["pixel_values", "logits"]
    assert shapes["pixel_values"] == (["batch", 3, 32, 32], float32)
    assert shapes["logits"] == (["batch", len(CLASSES)], float32)
    model_proto = onnx.load(str(check.path))
    assert [o.version for o in model_proto.opset_import if o.domain in ("", "ai.onnx")] == [18]  # README: opset 18
    assert {i.data_type for i in model_proto.graph.initializer if i.data_type in (1, 10, 11, 16)} == {float32}


# ---- the CLI and the model card -----------------------------------------------------------------------------
def test_cli_export_onnx_prints_the_difference(cli_export, tiny_model_dir):
    proc, out = cli_export["proc"], cli_export["out"]
    assert proc.returncode == 0, proc.stderr
    diff = DIFF_LINE.search(proc.stderr + proc.stdout)
    assert diff and float(diff.group(1)) <= 1e-4
    assert {"config.json", "model.safetensors", "README.md", "model.onnx"} <= {p.name for p in out.iterdir()}
    # fp16 safetensors, fp32 graph: the ONNX model gives the fp32 run's logits
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    assert np.abs(onnx_logits(out / "model.onnx", x) - torch_logits(load_model(str(tiny_model_dir)), x)).max() <= 1e-4
    assert io_shapes(out / "model.onnx")["pixel_values"][1] == onnx.TensorProto.FLOAT
    card = (out / "README.md").read_text()
    assert "model.safetensors (float16), model.onnx (float32" in card and "### ONNX Runtime" in card


def test_card_onnx_snippet_reproduces_timm_preprocessing(cli_export, tiny_model_dir, tmp_path, monkeypatch):
    """The card's onnxruntime snippet, run as written, gives PyTorch's probabilities on timm's eval transform."""
    import huggingface_hub
    import timm.data
    from PIL import Image

    out = cli_export["out"]
    assert cli_export["proc"].returncode == 0, cli_export["proc"].stderr
    card = (out / "README.md").read_text()
    snippet = card.split("### ONNX Runtime", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    pixels = np.random.default_rng(0).integers(0, 256, (45, 70, 3), dtype=np.uint8)  # landscape, not square
    Image.fromarray(pixels).save(tmp_path / "image.jpg")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name: str(out / name))
    namespace: dict = {}
    exec(compile(snippet, "card-snippet", "exec"), namespace)  # noqa: S102 - our own generated card

    model = load_model(str(tiny_model_dir)).eval()
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model), is_training=False)
    x = transform(Image.open(tmp_path / "image.jpg").convert("RGB")).unsqueeze(0)
    np.testing.assert_allclose(namespace["preprocess"](Image.open("image.jpg")), x.numpy(), atol=1e-5, rtol=0)
    expected = torch.softmax(model(x), dim=-1).detach().numpy()
    np.testing.assert_allclose(namespace["probs"], expected, atol=1e-5, rtol=0)
    assert namespace["labels"] == CLASSES


# ---- another resolution -----------------------------------------------------------------------------------------
def test_export_at_another_img_size(tiny_model_dir, tmp_path):
    out = export(tiny_model_dir, tmp_path / "out", onnx=True, img_size=48)
    config = json.loads((out / "config.json").read_text())
    assert config["pretrained_cfg"]["input_size"] == [3, 48, 48]  # config.json, weights and graph agree
    assert io_shapes(out / "model.onnx")["pixel_values"][0] == ["batch", 3, 48, 48]
    x = torch.randn(3, 3, 48, 48, generator=torch.Generator().manual_seed(5))
    resized = create_model(str(tiny_model_dir), pretrained=True, img_size=48)
    expected = torch_logits(resized, x)
    assert np.abs(onnx_logits(out / "model.onnx", x) - expected).max() <= 1e-4
    assert np.abs(torch_logits(load_model(str(out)), x) - expected).max() <= 1e-5
    assert "48 x 48 (trained at 32 x 32; position embedding resized" in (out / "README.md").read_text()
    with pytest.raises(VitftError, match="--img-size 4 is smaller than the model's patch size 8"):
        export(tiny_model_dir, tmp_path / "too_small", img_size=4)
    assert not (tmp_path / "too_small").exists()


# ---- failures ---------------------------------------------------------------------------------------------------
def test_failed_verification_leaves_no_onnx_file(tiny_model_dir, tmp_path, monkeypatch):
    write = onnx_export._write_onnx

    def write_corrupted(model, path, example):  # a wrong graph: the head's weights doubled after export
        write(model, path, example)
        proto = onnx.load(str(path))
        head = next(i for i in proto.graph.initializer if i.name == "head.weight")
        head.CopyFrom(onnx.numpy_helper.from_array(2 * onnx.numpy_helper.to_array(head), "head.weight"))
        onnx.save(proto, str(path))

    monkeypatch.setattr(onnx_export, "_write_onnx", write_corrupted)
    with pytest.raises(VitftError, match=r"does not match PyTorch.*exceeds 0.0001; model.onnx was not written"):
        export(tiny_model_dir, tmp_path / "new", onnx=True)
    assert list(tmp_path.iterdir()) == []  # no export folder, no staging folder

    old = tmp_path / "old"
    old.mkdir()
    (old / "model.onnx").write_bytes(b"the previous, verified model")
    with pytest.raises(VitftError, match="does not match PyTorch"):
        export_onnx(load_model(str(tiny_model_dir)), old)
    assert [p.name for p in old.iterdir()] == ["model.onnx"]
    assert (old / "model.onnx").read_bytes() == b"the previous, verified model"


def test_missing_extra_fails_before_any_work(tiny_model_dir, tmp_path, monkeypatch):
    import vit_finetune.weights.loading

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` raises ImportError

    def no_work(*args, **kwargs):
        raise AssertionError("the model was loaded before the missing extra was noticed")

    monkeypatch.setattr(vit_finetune.weights.loading, "load_model", no_work)
    with pytest.raises(VitftError, match=r"needs onnxruntime.*pip install -e '\.\[onnx\]' in a clone of vitft, "
                                         r"else pip install onnx onnxruntime onnxscript$"):
        export(tiny_model_dir, tmp_path / "out", onnx=True)
    assert not (tmp_path / "out").exists()


def test_cli_missing_extra_names_the_install_command(tiny_model_dir, tmp_path):
    proc = vitft("export", str(tiny_model_dir), str(tmp_path / "out"), "--onnx", block="onnx")
    assert proc.returncode == 1
    assert "pip install -e '.[onnx]' in a clone of vitft" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_onnx_export_into_a_folder_whose_name_is_not_utf8(tmp_path):
    export_onnx(tiny_classifier(), tmp_path / NOT_UTF8, batch_sizes=(1,))
    assert (tmp_path / NOT_UTF8 / "model.onnx").stat().st_size > 0
