from src.data.classification import TextClassificationDataModule
from src.data.mlm import MLMDataModule

__all__ = ["TextClassificationDataModule", "MLMDataModule"]
