"""The worker's fault-injection test hook: engine steps that fail on purpose, set by an environment variable."""

from __future__ import annotations

import os

__all__ = ["FAULT_INJECT_ENV", "FaultInjector", "InjectedDeviceError", "InjectedFault"]

FAULT_INJECT_ENV = "RINGSTREAM_FAULT_INJECT"
"""Test hook: ``step_exception_every=N[,worker=I][,kind=step|device]``, see :class:`FaultInjector`."""

KINDS = ("step", "device")


class InjectedFault(RuntimeError):
    """The failure :class:`FaultInjector` raises inside an engine step."""


class InjectedDeviceError(RuntimeError):
    """An injected failure worded as a CUDA error that poisons the device context (``kind=device``)."""


class FaultInjector:
    """Test hook: every ``step_exception_every``-th engine step raises.

    Configured by ``RINGSTREAM_FAULT_INJECT="step_exception_every=N[,worker=I][,kind=step|device]"``
    (``worker``: only the worker of that index; default every worker). ``kind=step`` (the default) raises
    :class:`InjectedFault`, a failed step; ``kind=device`` raises :class:`InjectedDeviceError`, worded as a
    CUDA error that poisons the context (an illegal memory access), which the worker answers by exiting for a
    restart. The exception is raised after the engine ran the step, so that step's tokens are lost, as in a
    real failure mid-step. Raises ValueError for a spec it cannot parse.
    """

    def __init__(self, spec: str) -> None:
        fields: dict[str, int | str] = {}
        usage = f"{FAULT_INJECT_ENV}={spec!r}: use step_exception_every=N[,worker=I][,kind=step|device]"
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in ("step_exception_every", "worker", "kind") or key in fields:
                raise ValueError(usage)
            if key == "kind":
                if value not in KINDS:
                    raise ValueError(usage)
                fields[key] = value
            else:
                fields[key] = int(value)
        if int(fields.get("step_exception_every", 0)) < 1:
            raise ValueError(f"{FAULT_INJECT_ENV}={spec!r}: step_exception_every must be >= 1")
        self.every = int(fields["step_exception_every"])
        self.worker = fields.get("worker")
        self.kind = str(fields.get("kind", "step"))
        self.steps = 0

    @classmethod
    def from_env(cls, worker_index: int) -> "FaultInjector | None":
        """The injector the environment asks for this worker, or None (the normal case)."""
        spec = os.environ.get(FAULT_INJECT_ENV)
        if not spec:
            return None
        injector = cls(spec)
        return injector if injector.worker in (None, worker_index) else None

    def wrap(self, step):
        """``step`` (an engine's ``step`` method), failing every ``every``-th call after it ran."""
        def faulty_step():
            outputs = step()
            self.steps += 1
            if self.steps % self.every == 0:
                where = f"injected at engine step {self.steps} ({FAULT_INJECT_ENV})"
                if self.kind == "device":
                    raise InjectedDeviceError(f"CUDA error: an illegal memory access was encountered ({where})")
                raise InjectedFault(f"injected fault at engine step {self.steps} ({FAULT_INJECT_ENV})")
            return outputs
        return faulty_step
