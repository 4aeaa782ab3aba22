"""Parallelism over several devices or processes: tensor parallelism for the targets
(`specd.parallel.tensor`). Data parallelism for training lives in `specd.train.data_parallel`."""

from specd.parallel.tensor import tensor_parallel

__all__ = ["tensor_parallel"]
