"""Launching forge-train on SLURM: the launch-shape check before submission and the hand-off to submitit's requeue."""

from forge.launch.requeue import requeue_via_submitit
from forge.launch.shape import LaunchShapeCheck, check_launch_shape, launch_world_size

__all__ = ["LaunchShapeCheck", "check_launch_shape", "launch_world_size", "requeue_via_submitit"]
