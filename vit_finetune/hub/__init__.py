"""Sharing a run: `export.py` writes a Hub-ready model folder (timm format, `card.py`'s model card, `onnx.py`'s
verified model.onnx), `push.py` uploads it to the Hugging Face Hub; `run.py` reads what they need from a run folder."""
