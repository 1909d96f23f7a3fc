"""Capture: what a forward pass records (q, k, masks, values) and how text becomes windows."""
