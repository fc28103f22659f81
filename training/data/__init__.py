"""Datasets: the synthetic shapes world, its task annotations and on-disk cache."""
