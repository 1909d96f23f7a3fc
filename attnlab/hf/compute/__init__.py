"""Compute: every variant's weights and row sums from captured q, k (kernels, buffers, lazy weights)."""
