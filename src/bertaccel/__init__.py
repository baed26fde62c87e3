"""bertaccel: fine-tune and pretrain BERT with PyTorch Lightning, measure where the time goes, and
make it fast with hand-written CUDA kernels.

    bertaccel fit -c configs/quickstart.yaml          # the command line (LightningCLI)
    from bertaccel.modules import BertClassifier      # the LightningModules
    from bertaccel.data import TextClassificationDataModule
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("bertaccel")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"
