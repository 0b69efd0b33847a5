"""kvstore.kernels."""
