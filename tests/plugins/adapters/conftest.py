"""Triton's interpreter for the LoRA kernels on a machine without CUDA (test_lora_launches.py).

``TRITON_INTERPRET=1`` must be set before Triton's first import, and ``peft`` imports
Triton: test_lora.py (collected first) imports ``peft``, so the test module that runs the
kernels cannot set it early enough itself when the directory runs as a whole.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton
