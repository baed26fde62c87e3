from src.modules.classifier import BertClassifier
from src.modules.mlm import BertMLM

__all__ = ["BertClassifier", "BertMLM"]
