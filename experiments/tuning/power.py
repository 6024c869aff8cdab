"""Board energy through NVML's total-energy counter, for energy per kernel call.

``EnergyMeter(i).read_j()``: the counter's joules; its difference over a second or more of
back-to-back calls, divided by the calls, is the sweep's energy per call (NaN without NVML).
"""

from __future__ import annotations

import os


def _nvml():
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver, no device: energy is NaN
        return None
    return pynvml


def _handle(nv, device_index: int):
    """NVML's handle of torch's CUDA device `device_index`, matched by UUID (NVML numbers every board
    of the host, torch the visible ones); by index only where no board is hidden, else None."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        return nv.nvmlDeviceGetHandleByUUID((uuid if uuid.startswith("GPU-") else "GPU-" + uuid).encode())
    except Exception:  # noqa: BLE001 - an old torch or driver without UUIDs
        if os.environ.get("CUDA_VISIBLE_DEVICES"):
            return None
        return nv.nvmlDeviceGetHandleByIndex(device_index)


class EnergyMeter:
    """Board energy (J) from NVML's total-energy counter; `available` False without NVML or a
    counter (pre-Volta boards, some virtualised GPUs)."""

    def __init__(self, device_index: int | None = 0):
        nv = _nvml() if device_index is not None else None
        self._nvml, self._handle = nv, None
        if nv is not None:
            try:
                handle = _handle(nv, device_index)
                nv.nvmlDeviceGetTotalEnergyConsumption(handle)
                self._handle = handle
            except Exception:  # noqa: BLE001 - no counter on this board: energy stays NaN
                pass

    @property
    def available(self) -> bool:
        return self._handle is not None

    def read_j(self) -> float:
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1e3  # mJ -> J
