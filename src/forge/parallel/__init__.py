"""Parallelism: environment, degrees, device mesh and the ordered parallel plan."""
