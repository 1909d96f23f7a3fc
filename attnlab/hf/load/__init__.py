"""Load: local Hugging Face checkpoints and attnlab's own, never from a hub, never pickles."""
