"""Shared pytest fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Tiny models: one intra-op thread is fastest and immune to a busy machine (OpenMP spin-waits)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory):
    """(wheel, sdist) built once per test session (``python -m build``, :mod:`helpers.wheel`)."""
    from helpers.wheel import build_wheel

    return build_wheel(tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="session")
def built_cpu_wheel(tmp_path_factory):
    """The CPU distribution's wheel (``verl-tokensel-cpu/``), built once per test session."""
    from helpers.wheel import build_cpu_wheel

    return build_cpu_wheel(tmp_path_factory.mktemp("dist_cpu"))
