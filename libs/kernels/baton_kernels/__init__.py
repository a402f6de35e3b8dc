"""Baton's kernels: attention backends behind one narrow interface, and small fused ops."""
