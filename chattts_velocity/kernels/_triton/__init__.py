"""Triton kernels and their launches, imported only when an op runs on Triton: CPU installs need no triton."""
