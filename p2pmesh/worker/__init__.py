"""The data-plane workers: the only package allowed to import MLX (tests/test_layering.py).

One worker process per rank and epoch: MLX groups live as long as their process, so the
agent starts fresh workers with MLX_RANK and MLX_HOSTFILE for every ring epoch.
"""
