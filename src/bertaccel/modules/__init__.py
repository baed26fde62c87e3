from bertaccel.modules.classifier import BertClassifier
from bertaccel.modules.mlm import BertMLM

__all__ = ["BertClassifier", "BertMLM"]
