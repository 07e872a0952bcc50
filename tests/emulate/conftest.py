"""Tests that build emulated clusters skip, saying why, where namespaces cannot be created
(not root, no iproute2, a container without CAP_SYS_ADMIN); CI runs as root and builds them."""
import pytest

from emulaterun import why_emulation_is_impossible


@pytest.fixture(scope="session")
def can_emulate():
    reason = why_emulation_is_impossible()
    if reason:
        pytest.skip(reason)
