"""What the host tier counts: hits per tier, bytes moved each way, copy time hidden or exposed."""

from __future__ import annotations

import attrs

from pitstop.plugins.allocators.tiered.copier import PageCopy


@attrs.define
class TierCounters:
    """Running totals since the allocator was built (exported as ``AllocatorStats.counters``).

    A copy's device time is *hidden* when nothing waited for it (a save ahead
    of eviction, a load done before the step that reads it was launched) and
    *exposed* otherwise (a load the next step had to wait on, a save waited
    for at eviction, and every copy on a CPU, which runs inline).
    """

    device_hit_tokens: int = 0  # prompt tokens served by the device prefix cache
    host_hit_tokens: int = 0  # prompt tokens served by the host tier (copied back)
    miss_tokens: int = 0  # prompt tokens neither tier held (computed)
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    copy_hidden_s: float = 0.0
    copy_exposed_s: float = 0.0
    waited_s: float = 0.0  # host time blocked waiting on copies (a part of the exposed time)
    saves_dropped: int = 0  # evicted pages not saved: every host slot busy

    def book(self, copy: PageCopy, *, exposed: bool) -> None:
        """Count a finished copy."""
        if copy.direction == "to_host":
            self.bytes_to_host += copy.nbytes
        else:
            self.bytes_to_device += copy.nbytes
        if exposed:
            self.copy_exposed_s += copy.seconds
        else:
            self.copy_hidden_s += copy.seconds

    def as_dict(self) -> dict[str, float]:
        """Every counter by name, as floats."""
        return {k: float(v) for k, v in attrs.asdict(self).items()}
