"""Optimizers beyond torch's: Muon / NorMuon for the encoder's weight matrices, AdamW for the rest."""

from bertaccel.optim.muon import MuonWithAdamW, orthogonalize

__all__ = ["MuonWithAdamW", "orthogonalize"]
