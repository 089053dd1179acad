"""What an operator asks of a running daemon besides its counters: how much memory its device has left."""

from __future__ import annotations

import os

import torch


def device_memory(device: torch.device) -> dict:
    """{"used_bytes", "total_bytes", "process_bytes"} of the daemon's device.

    CUDA: the whole device as nvidia-smi counts it (other processes included), and what this process's allocator
    holds. CPU: the machine's memory in use and in total, and this process's resident size."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"used_bytes": total - free, "total_bytes": total, "process_bytes": torch.cuda.memory_reserved(device)}
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    available = os.sysconf("SC_AVPHYS_PAGES") * page
    try:
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * page
    except (OSError, IndexError, ValueError):
        resident = 0
    return {"used_bytes": total - available, "total_bytes": total, "process_bytes": resident}
