"""The worker's device handling: its GPU made current, and a sticky CUDA error ending the process for a restart."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ringstream.daemon.engine import loader
from ringstream.daemon.worker.faults import FaultInjector, InjectedDeviceError, InjectedFault
from ringstream.daemon.worker.loop import Worker, device_lost

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "daemon" / "default_model"


@pytest.mark.parametrize("exc,lost", [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
    (RuntimeError("CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA`"), True),
    (RuntimeError("CUDA error: unspecified launch failure"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm`"), True),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("The size of tensor a (4) must match the size of tensor b (5)"), False),
    (RuntimeError("illegal memory access"), False),  # no CUDA: a CPU engine's error is not a device loss
    (InjectedFault("injected fault at engine step 3"), False),
    (InjectedDeviceError("CUDA error: an illegal memory access was encountered (injected)"), True),
])
def test_device_lost_names_the_sticky_cuda_errors_only(exc, lost):
    assert device_lost(exc) is lost


def test_the_fault_hook_raises_the_kind_it_is_given():
    calls = []

    def step():
        calls.append(1)
        return ["token"]

    for spec, error in (("step_exception_every=2", InjectedFault),
                        ("step_exception_every=2,kind=device", InjectedDeviceError)):
        faulty = FaultInjector(spec).wrap(step)
        assert faulty() == ["token"]
        with pytest.raises(error) as raised:
            faulty()
        assert device_lost(raised.value) is (error is InjectedDeviceError)
    assert len(calls) == 4  # the failing steps ran before raising
    for bad in ("step_exception_every=2,kind=gpu", "kind=device", "step_exception_every=2,kind=step,kind=step",
                "step_delay_ms=-1", "step_exception_every=0", "worker=0"):
        with pytest.raises(ValueError, match="step_exception_every"):
            FaultInjector(bad)


def test_the_fault_hook_can_slow_every_step_without_failing_any():
    slow = FaultInjector("step_delay_ms=20")
    faulty = slow.wrap(lambda: ["token"])
    start = time.monotonic()
    assert [faulty() for _ in range(5)] == [["token"]] * 5
    assert time.monotonic() - start >= 5 * 0.020  # a lower bound only: sleeps never end early
    assert slow.describe() == "every engine step sleeps 20 ms"
    assert FaultInjector("step_exception_every=3,step_delay_ms=1").describe() == (
        "every 3-th engine step fails (step), every engine step sleeps 1 ms")


def test_a_gpu_worker_makes_its_device_current_before_loading(monkeypatch):
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        pytest.skip("daemon/default_model is not present")
    events = []

    class Loaded(Exception):
        pass

    def fake_load(info, device, dtype):
        events.append(("load", device))
        raise Loaded

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: events.append(("set_device", str(device))))
    monkeypatch.setattr(loader, "load_model", fake_load)
    worker = Worker.__new__(Worker)
    worker._enter = lambda phase: events.append(("phase", phase)) if phase == "loading weights" else None
    worker.spec = SimpleNamespace(model_path=str(DEFAULT_MODEL_DIR),
                                  engine=SimpleNamespace(backend="paged", device="cuda:1", threads=0,
                                                         dtype="auto", max_model_len=None))
    with pytest.raises(Loaded):
        worker._build_engine()
    assert events == [("set_device", "cuda:1"), ("phase", "loading weights"), ("load", "cuda:1")]
