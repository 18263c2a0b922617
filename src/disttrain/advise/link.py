"""A network link as the cost model sees it: bandwidth and one-way latency (the α and β of
the α-β model), spelled by a user as `1gbit,0.2ms`.

Bandwidth units: `kbit`, `mbit`, `gbit` (bits per second, powers of ten); latency units:
`us`, `ms`, `s`. `10gbit,50us` is a 10 Gbit/s link with 50 microseconds one way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from disttrain.core.errors import ConfigError

BANDWIDTH_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
LATENCY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
LINK_FORM = "BANDWIDTH,LATENCY, e.g. 1gbit,0.2ms (kbit, mbit or gbit; us, ms or s)"
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"
_PATTERN = re.compile(rf"^\s*(?P<bw>{_NUMBER})\s*(?P<bw_unit>[a-z]+)\s*,\s*"
                      rf"(?P<lat>{_NUMBER})\s*(?P<lat_unit>[a-z]+)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Link:
    """A full-duplex link.

    Args:
        bandwidth_bytes_per_s: bytes per second each way (β's inverse).
        latency_s: one-way latency of a message (α).
        source: how it was obtained: "given", "loopback" or "peer HOST:PORT".
    """

    bandwidth_bytes_per_s: float
    latency_s: float
    source: str = "given"

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or self.latency_s < 0:
            raise ValueError(f"a link needs a positive bandwidth and a latency >= 0, not "
                             f"{self.bandwidth_bytes_per_s} B/s and {self.latency_s} s")

    def transfer_s(self, num_bytes: float) -> float:
        """Seconds the bytes take on the wire, latency apart."""
        return num_bytes / self.bandwidth_bytes_per_s

    def describe(self) -> str:
        bandwidth, latency = format_bandwidth(self.bandwidth_bytes_per_s), format_latency(self.latency_s)
        return f"{bandwidth}, {latency} ({self.source})"

    def to_dict(self) -> dict[str, float | str]:
        return {"bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "latency_s": self.latency_s,
                "source": self.source}


def parse_link(text: str) -> Link:
    """The link spelled `text`, e.g. `1gbit,0.2ms`.

    Raises:
        ConfigError: one line naming the accepted form.
    """
    match = _PATTERN.match(text)
    bw_unit = match and match["bw_unit"].lower()
    lat_unit = match and match["lat_unit"].lower()
    if match is None or bw_unit not in BANDWIDTH_UNITS or lat_unit not in LATENCY_UNITS:
        raise ConfigError(f"--link {text!r}: write {LINK_FORM}")
    bandwidth = float(match["bw"]) * BANDWIDTH_UNITS[bw_unit] / 8
    if bandwidth <= 0:
        raise ConfigError(f"--link {text!r}: the bandwidth must be positive; write {LINK_FORM}")
    return Link(bandwidth, float(match["lat"]) * LATENCY_UNITS[lat_unit], "given")


def format_bandwidth(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def format_latency(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"
