"""Board power sampled through NVML in a background thread, for energy per kernel call.

``with PowerSampler(device_index) as p: ...`` samples the board's power (W) every `period_s`
while the block runs; ``p.mean_w`` is the mean of the samples (NaN without NVML: the
``nvidia-ml-py`` package, a CUDA device, a driver). Energy per call (J) = mean power (W) x time
per call (s). The samples span do_bench's whole window (warm-up, L2 flushes, timed runs), so
the figure is the board's power while the kernel runs back to back, idle power included: fine
for comparing configurations of one kernel, not an isolated kernel's energy. The instantaneous
reading (``NVML_FI_DEV_POWER_INSTANT``) is used where the driver has it; otherwise
``nvmlDeviceGetPowerUsage``, which some drivers average over up to a second.

That sampling does not resolve a 40 ms timing window: on an H200 (driver 580) a quarter of the
sweep's rows read the idle board (122-126 W, the same value for configs in a row) beside
350-860 W for their neighbours. :class:`EnergyMeter` reads the board's total-energy counter
(``nvmlDeviceGetTotalEnergyConsumption``, mJ since the driver loaded) before and after a window
of back-to-back calls of a second or more: energy per call = counter difference / calls. The
sweep measures that for the configs that matter to an energy-aware choice (the up to 3 fastest
within 5% of a shape's fastest, and the hand rule's).
"""

from __future__ import annotations

import math
import os
import threading
import time


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
    """NVML's handle of torch's CUDA device `device_index`. NVML numbers every board of the host
    and ignores CUDA_VISIBLE_DEVICES, torch numbers the visible ones: match the board by UUID;
    by index only where no board is hidden (else None: no reading rather than another board's)."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        return nv.nvmlDeviceGetHandleByUUID((uuid if uuid.startswith("GPU-") else "GPU-" + uuid).encode())
    except Exception:  # noqa: BLE001 - an old torch or driver without UUIDs
        if os.environ.get("CUDA_VISIBLE_DEVICES"):
            return None
        return nv.nvmlDeviceGetHandleByIndex(device_index)


class PowerSampler:
    """Mean board power (W) over a `with` block; NaN when NVML is unavailable."""

    def __init__(self, device_index: int | None = 0, period_s: float = 0.005):
        """device_index: torch's index of the CUDA device; None samples nothing (a CPU run)."""
        self.period_s, self.samples = period_s, []
        self._nvml = _nvml() if device_index is not None else None
        self._handle = _handle(self._nvml, device_index) if self._nvml else None
        self._instant = self._handle is not None and self._read_instant() is not None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self._handle is not None

    def _read_instant(self) -> float | None:
        nv = self._nvml
        field = getattr(nv, "NVML_FI_DEV_POWER_INSTANT", None)
        if field is None:
            return None
        try:
            v = nv.nvmlDeviceGetFieldValues(self._handle, [field])[0]
            if v.nvmlReturn != 0:
                return None
            return float(v.value.uiVal) / 1e3  # mW -> W
        except Exception:  # noqa: BLE001 - an old driver: fall back to the averaged reading
            return None

    def read_w(self) -> float:
        if self._instant:
            w = self._read_instant()
            if w is not None:
                return w
        return self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.read_w())
            except Exception:  # noqa: BLE001 - a failed read loses one sample, not the run
                pass
            time.sleep(self.period_s)

    def __enter__(self) -> "PowerSampler":
        self.samples = []
        if self.available:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    @property
    def mean_w(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else math.nan


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
