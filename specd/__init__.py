"""specd: speculative decoding split across processes (D3D drafter, lossless verifier, SpecOPD trainer)."""

__version__ = "0.1.0"
