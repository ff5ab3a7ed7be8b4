"""genoctx: post-train hybrid long-context models on the human genome."""

__version__ = "0.1.0"
