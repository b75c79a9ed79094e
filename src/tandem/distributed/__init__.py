"""Tensor parallelism's process groups, rank information and collectives (`group.py`), and how a
model's heads and rows are split over the ranks (`sharding.py`)."""
