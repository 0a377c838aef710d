"""Triton kernels and their launches; imported only when an op runs on Triton, so CPU installs need no triton."""
