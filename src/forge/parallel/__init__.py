"""Parallelism: environment, device mesh and the ordered parallel plan."""
