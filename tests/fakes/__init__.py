"""Fakes of the vendor stack for unit tests (no SUPA card exists here)."""

from tests.fakes.torch_br_fake import FakeStack, installed_fake_torch_br

__all__ = ["FakeStack", "installed_fake_torch_br"]
