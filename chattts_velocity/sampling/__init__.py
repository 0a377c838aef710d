"""Sampling settings' limits (``limits``) and upstream ChatTTS's logit processors (``processors``), which the
reference decode samples through. The engine's sampler is ``engine/sampler.py``; its kernels are
``kernels/sampling*.py``."""
