"""Version gate and the reversible patcher: no TE needed."""

from __future__ import annotations

import types

import pytest

from te_compile.errors import UnsupportedVersionError
from te_compile.patching import Patcher, Swap
from te_compile.versions import check_versions


def test_supported_versions_pass():
    check_versions("2.11.0+cu130", "2.20.2")
    check_versions("2.14.1", "2.20.0")


@pytest.mark.parametrize(
    "torch_ver,te_ver,fragment",
    [
        ("2.10.0+cu128", "2.20.2", "torch 2.10.0+cu128 is too old"),
        ("2.11.0", "2.19.1", "2.19.1 is not"),
    ],
)
def test_unsupported_versions_name_both(torch_ver, te_ver, fragment):
    with pytest.raises(UnsupportedVersionError) as info:
        check_versions(torch_ver, te_ver)
    msg = str(info.value)
    assert fragment in msg and torch_ver in msg and te_ver in msg and "Supported:" in msg


class Base:
    @classmethod
    def who(cls):
        return "base"


class Child(Base):
    pass


def test_patcher_is_idempotent_and_reversible():
    module = types.ModuleType("transformer_engine_fake")
    module.f = lambda: "orig"
    patcher = Patcher()
    swaps = [Swap(module, "f", lambda: "new"), Swap(Child, "who", classmethod(lambda c: "new"))]
    patcher.apply(swaps)
    patcher.apply(swaps)  # second apply is a no-op
    assert module.f() == "new" and Child.who() == "new" and Base.who() == "base"
    patcher.revert()
    patcher.revert()
    assert module.f() == "orig" and Child.who() == "base"
    assert "who" not in vars(Child)  # the inherited attribute was not copied onto the child
