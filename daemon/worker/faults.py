"""The worker's fault-injection test hook: engine steps that fail or run slow on purpose, set by an environment
variable."""

from __future__ import annotations

import os
import time

__all__ = ["FAULT_INJECT_ENV", "FaultInjector", "InjectedDeviceError", "InjectedFault"]

FAULT_INJECT_ENV = "RINGSTREAM_FAULT_INJECT"
"""Test hook: ``step_exception_every=N[,worker=I][,kind=step|device]`` and / or ``step_delay_ms=D``, see
:class:`FaultInjector`."""

KINDS = ("step", "device")


class InjectedFault(RuntimeError):
    """The failure :class:`FaultInjector` raises inside an engine step."""


class InjectedDeviceError(RuntimeError):
    """An injected failure worded as a CUDA error that poisons the device context (``kind=device``)."""


class FaultInjector:
    """Test hook: every ``step_exception_every``-th engine step raises; every step takes ``step_delay_ms`` longer.

    Configured by ``RINGSTREAM_FAULT_INJECT="step_exception_every=N[,step_delay_ms=D][,worker=I][,kind=step|device]"``
    (``worker``: only the worker of that index; default every worker; at least one of ``step_exception_every`` and
    ``step_delay_ms``). ``kind=step`` (the default) raises :class:`InjectedFault`, a failed step; ``kind=device``
    raises :class:`InjectedDeviceError`, worded as a CUDA error that poisons the context (an illegal memory access),
    which the worker answers by exiting for a restart. The exception is raised after the engine ran the step, so
    that step's tokens are lost, as in a real failure mid-step. ``step_delay_ms`` sleeps that many milliseconds after
    each step: a slow device, so that a test's deadline falls mid-stream however fast the engine is. Raises
    ValueError for a spec it cannot parse.
    """

    def __init__(self, spec: str) -> None:
        fields: dict[str, int | str] = {}
        usage = (f"{FAULT_INJECT_ENV}={spec!r}: use step_exception_every=N and / or step_delay_ms=D"
                 "[,worker=I][,kind=step|device]")
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in ("step_exception_every", "step_delay_ms", "worker", "kind") or key in fields:
                raise ValueError(usage)
            if key == "kind":
                if value not in KINDS:
                    raise ValueError(usage)
                fields[key] = value
            else:
                fields[key] = int(value)
        if "step_exception_every" not in fields and "step_delay_ms" not in fields:
            raise ValueError(usage)
        if int(fields.get("step_exception_every", 1)) < 1 or int(fields.get("step_delay_ms", 0)) < 0:
            raise ValueError(f"{FAULT_INJECT_ENV}={spec!r}: step_exception_every must be >= 1, step_delay_ms >= 0")
        self.every = int(fields["step_exception_every"]) if "step_exception_every" in fields else None
        """Every how many steps one raises; None: none does."""
        self.delay_s = int(fields.get("step_delay_ms", 0)) / 1000
        """Seconds each step sleeps after it ran."""
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

    def describe(self) -> str:
        """What the hook does, in words, for the worker's log."""
        parts = [f"every {self.every}-th engine step fails ({self.kind})"] if self.every is not None else []
        if self.delay_s:
            parts.append(f"every engine step sleeps {self.delay_s * 1000:g} ms")
        return ", ".join(parts)

    def wrap(self, step):
        """``step`` (an engine's ``step`` method), sleeping ``delay_s`` after each call and failing every
        ``every``-th call after it ran."""
        def faulty_step():
            outputs = step()
            self.steps += 1
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.every is not None and self.steps % self.every == 0:
                where = f"injected at engine step {self.steps} ({FAULT_INJECT_ENV})"
                if self.kind == "device":
                    raise InjectedDeviceError(f"CUDA error: an illegal memory access was encountered ({where})")
                raise InjectedFault(f"injected fault at engine step {self.steps} ({FAULT_INJECT_ENV})")
            return outputs
        return faulty_step
