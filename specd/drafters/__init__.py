"""Drafters: anything that proposes a block after a committed context (see `base.Drafter`)."""

from specd.drafters.base import DraftBlock, Drafter, DraftRequest, Outcome, check_block_size
from specd.drafters.ngram import NgramDrafter

__all__ = ["DraftBlock", "DraftRequest", "Drafter", "NgramDrafter", "Outcome", "check_block_size"]
