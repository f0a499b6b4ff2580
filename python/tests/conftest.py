"""Shared fixtures: every test gets its own profile directory and a clean DDO_* environment,
and runs on the host-simulation device ("sim"): no GPU needed, nothing downloaded."""

import os

import pytest
import torch


def pytest_report_header(config):
    import ddo

    return f"ddo package: {os.path.dirname(ddo.__file__)}; torch {torch.__version__}"


@pytest.fixture(autouse=True)
def clean_ddo_env(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith("DDO_"):
            monkeypatch.delenv(key)
    profiles = tmp_path / "profiles"
    monkeypatch.setenv("DDO_PROFILE_DIR", str(profiles))
    torch.manual_seed(0)
    yield profiles


@pytest.fixture
def profile_dir(clean_ddo_env):
    return clean_ddo_env


# Streams every weight of a tiny model: no resident budget, no auto policy, a threshold below
# the tiny tensors, so the interception really runs (the presets keep small tensors resident).
STREAM_ALL = dict(
    execution_device="sim",
    auto_budget_policy="off",
    resident_module_budget_gb=0.0,
    small_tensor_threshold_bytes=0,
    always_resident_modules_pattern=[],
)
