"""Conformance suites that third-party strategies run against themselves.

``pitstop.testing.allocator`` holds the allocator contract: see
:class:`AllocatorStateMachine`, :func:`allocator_state_machine` and
:func:`check_allocator`; ``pitstop.testing.scheduler`` the scheduler
contract (:func:`~pitstop.testing.scheduler.check_scheduler_contract`);
``pitstop.testing.kernels`` the kernel-set check against the reference
(:func:`~pitstop.testing.kernels.check_kernel_set`); ``pitstop.testing.adapters`` the
adapter-method check, row by row against each adapter's reference
(:func:`~pitstop.testing.adapters.check_adapters`); ``pitstop.testing.verifiers`` the draft-verifier
check (:func:`~pitstop.testing.verifiers.check_verifier`). Importing this package needs ``hypothesis`` (a test
dependency: ``pip install pitstop[test]``).
"""

from __future__ import annotations

from pitstop.testing.allocator import (
    AllocatorStateMachine,
    allocator_state_machine,
    check_allocator,
)

__all__ = ["AllocatorStateMachine", "allocator_state_machine", "check_allocator"]
