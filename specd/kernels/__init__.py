"""Triton kernels for the hot spots, each beside its plain-torch reference (one file per kernel).

Every kernel runs on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (how `make test` checks
it against its reference). `specd.kernels.runtime` says whether a kernel can run on a tensor's
device and keeps autotuning to one config under the interpreter.
"""
