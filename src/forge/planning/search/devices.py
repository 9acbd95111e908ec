"""What the search assumes of one accelerator: its memory and the bandwidth of the links inside and across nodes.

Peak FLOP/s come from forge.planning.peak's table (one place for them). Memory is what torch reports as the device's
total; bandwidths are per GPU and per direction, in bytes per second: NVLink (or Infinity Fabric) inside a node, the
node's network (InfiniBand / RoCE) divided over its GPUs across nodes.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from forge.planning.peak import table_peak

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Device:
    name: str
    """The peak table's name (forge.planning.peak.PEAK_TFLOPS)."""
    memory_gib: float
    intra_node: float
    """Bytes/s per GPU inside a node."""
    inter_node: float
    """Bytes/s per GPU across nodes."""
    peaks: dict[str, float] | None = None
    """Measured FLOP/s by dtype (a calibrated profile); None: the peak table's."""
    shares_cores: bool = False
    """A CPU host whose ranks outnumber its cores (a calibrated profile says so): a rank that waits in a
    pipeline's bubble leaves its cores to the busy ones, so the bubble costs no time (the per-rank rate was
    measured with every rank computing at once), and the data-parallel collectives, which gloo runs on the same
    cores, are not hidden behind the backward."""
    latency_s: float | None = None
    """Seconds of one small collective (a calibrated profile measures it); None: forge.planning.search.cost.LATENCY_S, a
    GPU's launch inside and across nodes."""
    latency_ranks: int | None = None
    """The ranks latency_s was measured over (a calibrated profile's world size): a smaller group's collectives are
    charged less of it (forge.planning.search.cost.latency_share)."""

    def peak_flops(self, dtype: str) -> float:
        flops = self.peaks.get(dtype) if self.peaks else table_peak(self.name, dtype)
        if flops is None:
            raise ValueError(f"no peak FLOP/s for {self.name} in {dtype}")
        return flops


DEVICES = {
    "h100": Device("H100", 79.6, 450 * GB, 50 * GB),  # NVLink 4 (900 GB/s both ways), 8 x 400 Gb/s NICs
    "h200": Device("H200", 139.8, 450 * GB, 50 * GB),
    "a100": Device("A100", 79.2, 300 * GB, 25 * GB),  # NVLink 3, 8 x 200 Gb/s NICs
    "b200": Device("B200", 178.4, 900 * GB, 50 * GB),  # NVLink 5
    "mi300x": Device("MI300X", 178.8, 448 * GB, 50 * GB),  # Infinity Fabric, 7 links x 64 GB/s
}
"""By the name `search.device` takes."""


def device_from_profile(path: str | Path) -> Device:
    """The Device a `forge-train --calibrate` profile describes (JSON: data only). ValueError names the file and
    the key that is missing or not a positive number."""
    path = Path(path).expanduser()
    try:
        profile = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"search.profile={path}: not a readable JSON device profile ({err})") from err

    def positive(value, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"search.profile={path}: {key} is {value!r}, not a positive number")
        return float(value)

    if not isinstance(profile, dict) or not isinstance(profile.get("peak_flops"), dict):
        raise ValueError(f"search.profile={path}: no peak_flops (write one with forge-train --calibrate)")
    inter = positive(profile.get("inter_node"), "inter_node")
    intra = positive(profile["intra_node"], "intra_node") if profile.get("intra_node") is not None else inter
    peaks = {dtype: positive(value, f"peak_flops.{dtype}") for dtype, value in profile["peak_flops"].items()}
    name = str(profile.get("name", path.stem))
    shares = profile.get("shares_cores", False)
    if not isinstance(shares, bool):
        raise ValueError(f"search.profile={path}: shares_cores is {shares!r}, not true or false")
    latency = profile.get("collective_latency_s")
    latency = positive(latency, "collective_latency_s") if latency is not None else None
    ranks = profile.get("world_size")
    if ranks is not None and (isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1):
        raise ValueError(f"search.profile={path}: world_size is {ranks!r}, not a positive integer")
    ranks = ranks if latency is not None else None
    return Device(name, positive(profile.get("memory_gib"), "memory_gib"), intra, inter, peaks, shares, latency, ranks)
