"""Optimizers beyond torch's: Muon / NorMuon for the encoder's weight matrices, AdamW for the rest; the fits'
learning-rate schedule."""

from bertaccel.optim.muon import MuonWithAdamW, orthogonalize
from bertaccel.optim.schedule import LinearWarmupDecay

__all__ = ["LinearWarmupDecay", "MuonWithAdamW", "orthogonalize"]
