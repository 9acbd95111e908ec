"""The options of `--plan --search` (the `search` config group extends this as its schema)."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class SearchSettings:
    device: str = "h100"
    """The accelerator: a key of forge.search.devices.DEVICES (`forge-train --plan --search` names them when it
    does not know the one given)."""
    profile: Optional[str] = None
    """A device profile written by `forge-train --calibrate` (measured matmul rates, memory, link bandwidths);
    it replaces `device`'s table entry. null: the table."""
    memory_gib: Optional[float] = None
    """Device memory per GPU in GiB; null: the device's."""
    gpus_per_node: int = 8
    """GPUs per node: a mesh dimension whose ranks fit in one node uses the intra-node link."""
    intra_node_gbps: Optional[float] = None
    """GB/s per GPU and direction inside a node; null: the device's (NVLink)."""
    inter_node_gbps: Optional[float] = None
    """GB/s per GPU and direction across nodes; null: the device's (the network)."""
    compute_efficiency: float = 0.5
    """Fraction of the peak FLOP/s the matmuls reach."""
    comm_efficiency: float = 0.7
    """Fraction of a link's bandwidth a collective reaches."""
    memory_headroom: float = 0.1
    """Fraction of device memory kept free (allocator fragmentation, CUDA context, NCCL buffers)."""
    max_micro_batch_size: int = 16
    """Largest micro-batch size tried (powers of two that divide each rank's share of the global batch)."""
    top: int = 5
    """Rows of the table (each checked by validation)."""
