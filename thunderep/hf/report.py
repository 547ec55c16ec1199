"""What one rank read and holds after `ThunderMoE.from_pretrained` (`LoadReport`), and the process
memory it is measured with."""

from __future__ import annotations

from dataclasses import dataclass, field

import psutil

__all__ = ["LoadReport", "rss_bytes"]


def rss_bytes() -> int:
    """This process's resident memory now (memory-mapped file pages it touched included)."""
    return psutil.Process().memory_info().rss


@dataclass
class LoadReport:
    """What one rank read and holds after `from_pretrained`.

    bytes_read / bytes_total: checkpoint bytes this rank read / all tensor bytes of the checkpoint.
    expert_bytes / replicated_bytes: this rank's tensors after loading (in the model's dtype).
    rss_before / rss_after / peak_rss: process resident memory before the weights are materialised (libraries
        imported, model on the meta device), after loading (checkpoint unmapped), and its peak while loading
        (sampled after every checkpoint tensor; it counts the memory-mapped checkpoint pages this rank
        touched, about bytes_read, which are shared page cache the kernel can drop).
    cuda_peak: torch.cuda.max_memory_allocated on this rank's GPU (0 on CPU).
    unused_keys: checkpoint tensors that match nothing in the model (e.g. old rotary buffers).
    dequantized: the checkpoint's quant_method ("fp8", "mxfp4", "compressed-tensors") where its weights were read
        dequantized, else None.
    """

    path: str
    files: int
    tensors_read: int
    bytes_read: int
    bytes_total: int
    expert_bytes: int
    replicated_bytes: int
    rss_before: int
    rss_after: int
    peak_rss: int
    cuda_peak: int
    seconds: float
    unused_keys: list = field(default_factory=list)
    dequantized: str | None = None

    def summary(self) -> str:
        mb = 1 / 2**20
        how = f" ({self.dequantized}, dequantized)" if self.dequantized else ""
        return (f"read {self.bytes_read * mb:.1f} of {self.bytes_total * mb:.1f} MiB{how} ({self.tensors_read} "
                f"tensors, {self.files} files) in {self.seconds:.2f} s; holds experts "
                f"{self.expert_bytes * mb:.1f} MiB + replicated {self.replicated_bytes * mb:.1f} MiB; RSS "
                f"{self.rss_before * mb:.0f} -> {self.rss_after * mb:.0f} MiB, peak {self.peak_rss * mb:.0f} MiB")
