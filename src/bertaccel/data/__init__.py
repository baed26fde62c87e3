from bertaccel.data.classification import TextClassificationDataModule
from bertaccel.data.mlm import MLMDataModule

__all__ = ["TextClassificationDataModule", "MLMDataModule"]
