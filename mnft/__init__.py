"""mnft: multi-node fine-tuning for bare-metal GPU labs without a scheduler."""

__version__ = "0.1.0"
