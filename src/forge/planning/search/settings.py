"""The options of `--plan --search` (the `search` config group extends this as its schema)."""

from dataclasses import dataclass
from typing import Optional

from forge.domain import domain


@dataclass
class SearchSettings:
    device: str = domain("h100", non_empty=True)
    """The accelerator: a key of forge.planning.search.devices.DEVICES (`forge-train --plan --search` names them when it
    does not know the one given)."""
    profile: Optional[str] = domain(None, non_empty=True)
    """A device profile written by `forge-train --calibrate` (measured matmul rates, memory, link bandwidths);
    it replaces `device`'s table entry. null: the table."""
    memory_gib: Optional[float] = domain(None, gt=0)
    """Device memory per GPU in GiB; null: the device's."""
    gpus_per_node: int = domain(8, ge=1)
    """GPUs per node: a mesh dimension whose ranks fit in one node uses the intra-node link."""
    intra_node_gbps: Optional[float] = domain(None, gt=0)
    """GB/s per GPU and direction inside a node; null: the device's (NVLink)."""
    inter_node_gbps: Optional[float] = domain(None, gt=0)
    """GB/s per GPU and direction across nodes; null: the device's (the network)."""
    compute_efficiency: float = domain(0.5, gt=0, le=1)
    """Fraction of the peak FLOP/s the matmuls reach."""
    comm_efficiency: float = domain(0.7, gt=0, le=1)
    """Fraction of a link's bandwidth a collective reaches."""
    memory_headroom: float = domain(0.1, ge=0, lt=1)
    """Fraction of device memory kept free (allocator fragmentation, CUDA context, NCCL buffers)."""
    max_micro_batch_size: int = domain(16, ge=1)
    """Largest micro-batch size tried (powers of two that divide each rank's share of the global batch)."""
    top: int = domain(5, ge=1)
    """Rows of the table (each checked by validation)."""
