"""vitft: fine-tune Vision Transformers, with a native ViT that loads every timm ViT checkpoint."""
from .archs import ALIASES, list_archs
from .errors import VitftError
from .evaluate import EvalReport, Prediction, evaluate, predict
from .explain import Explanation, explain
from .hub import PushResult, export, push
from .model import VisionTransformer
from .pos_embed import resize_pos_embed
from .train import RunResult, TrainConfig, finetune
from .weights import create_model, load_model, save_pretrained

__version__ = "0.1.0"

__all__ = [
    "ALIASES", "EvalReport", "Explanation", "Prediction", "PushResult", "RunResult", "TrainConfig",
    "VisionTransformer", "VitftError", "create_model", "evaluate", "explain", "export", "finetune", "list_archs",
    "load_model", "predict", "push", "resize_pos_embed", "save_pretrained",
]
