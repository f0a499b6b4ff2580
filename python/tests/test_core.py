"""Config, presets, settings loader and the legacy host-context API (ddo_core through the
binding). The error table is test_errors.py."""

import json
import os

import pytest
import torch

import ddo
from ddo import _C

SPEC_FIELDS = [
    "execution_device", "offload_device", "skip_modules_pattern",
    "always_resident_modules_pattern", "small_tensor_threshold_bytes", "execution_mode",
    "pin_cpu_memory", "allow_pin_memory_fallback", "pin_cpu_workers", "cache_plan",
    "cache_pinned_weights", "pinned_weight_cache_namespace", "auto_budget_policy",
    "max_resident_module_budget_gb", "auto_vram_headroom_gb", "profile_vram_headroom_gb",
    "profile_name", "build_profile", "max_pin_weight_budget_gb", "available_system_ram_gb",
    "system_ram_headroom_gb", "pin_weight_budget_gb", "pin_weight_budget_ratio",
    "pin_weight_selection", "resident_module_selection", "resident_module_budget_gb",
    "resident_module_patterns", "load_safetensors_backend", "verbose", "show_profile",
]


def test_config_has_every_spec_field_with_spec_defaults():
    config = ddo.DynamicOffloadConfig()
    names = ddo.DynamicOffloadConfig.field_names()
    for field in SPEC_FIELDS:
        assert field in names, field
    assert config.execution_device == "cuda:0"
    assert config.offload_device == "cpu"
    assert config.small_tensor_threshold_bytes == 16 * 1024
    assert config.execution_mode == "plan"
    assert config.pin_cpu_memory is False
    assert config.allow_pin_memory_fallback is True
    assert config.pin_cpu_workers == 1
    assert config.auto_budget_policy == "off"
    assert config.max_resident_module_budget_gb == 6.0
    assert config.profile_vram_headroom_gb == 1.0
    assert config.available_system_ram_gb is None
    assert config.system_ram_headroom_gb == 6.0
    assert config.pin_weight_selection == "spread"
    assert config.resident_module_selection == "spread"
    assert config.resident_module_budget_gb == 0.0
    assert config.show_profile is True
    json.dumps(config.to_dict())  # JSON-safe


def test_config_fields_are_checked_by_core():
    config = ddo.DynamicOffloadConfig(execution_mode="linear_runtime", resident_module_budget_gb=4)
    assert config.execution_mode == "linear_runtime"
    assert config.resident_module_budget_gb == 4.0
    config.pin_cpu_memory = True
    assert config.pin_cpu_memory is True
    with pytest.raises(TypeError, match="pin_memory"):
        config.pin_memory = True
    with pytest.raises(TypeError, match="resident_budget"):
        ddo.DynamicOffloadConfig(resident_budget=3)
    with pytest.raises(ValueError, match="execution_mode"):
        config.execution_mode = "fast"
    with pytest.raises(ValueError):
        config.pin_cpu_workers = 0
    assert config.pin_cpu_workers == 1  # all or nothing
    assert config.replace(verbose=True).verbose is True
    assert config.verbose is False
    assert config == ddo.DynamicOffloadConfig.from_dict(config.to_dict())


def test_presets():
    names = ddo.preset_names()
    assert names[0] == "auto"
    for p in ["one_shot_fast", "low_ram_safe", "wsl_compat", "warm_process",
              "diffusers_offload_compat", "diffusers_leaf_offload_compat", "off"]:
        assert p in names
    assert ddo.resolve_preset("auto")["name"] == "one_shot_fast"
    fast = ddo.preset_config("auto")
    assert fast.execution_mode == "linear_runtime"
    assert fast.pin_cpu_memory is True and fast.pin_cpu_workers == 4
    assert fast.auto_budget_policy == "balanced"
    low = ddo.preset_config("low_ram_safe")
    assert low.resident_module_budget_gb == 3.0 and low.pin_cpu_memory is False
    with pytest.raises(ValueError, match="one_shot_fast"):
        ddo.resolve_preset("fast")
    assert ddo.resolve_preset("off")["enabled"] is False


def test_settings_loader_reads_the_environment(monkeypatch):
    monkeypatch.setenv("DDO_RESIDENT_MODULE_BUDGET_GB", "4")
    monkeypatch.setenv("DDO_VAE_ROUTE", "device")
    monkeypatch.setenv("DDO_PROFILE_VRAM_HEADROOM_GB", "2.5")
    settings = ddo.DynamicOffloadSettings.from_env(preset="low_ram_safe", verbose=True)
    assert settings.requested_preset == "low_ram_safe"
    assert settings.effective_preset == "low_ram_safe"
    assert settings.config.resident_module_budget_gb == 4.0
    assert settings.config.profile_vram_headroom_gb == 2.5
    assert settings.config.verbose is True
    assert settings.policy_for("vae")["route"] == "device"
    assert settings.policy_for("transformer")["route"] == "dynamic"
    json.dumps(settings.to_dict())


def test_settings_loader_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("DDO_RESIDENT_MODULE_BUDGET_GB", "6GB")
    with pytest.raises(ValueError, match="DDO_RESIDENT_MODULE_BUDGET_GB"):
        ddo.DynamicOffloadSettings.from_env()
    monkeypatch.delenv("DDO_RESIDENT_MODULE_BUDGET_GB")
    with pytest.raises(TypeError, match="not_a_field"):
        ddo.DynamicOffloadSettings.from_env(not_a_field=1)


def test_settings_preset_from_env_and_explicit_config(monkeypatch):
    monkeypatch.setenv("DDO_PRESET", "wsl_compat")
    assert ddo.DynamicOffloadSettings.from_env().effective_preset == "wsl_compat"
    config = ddo.DynamicOffloadConfig(execution_mode="linear_runtime", pin_cpu_workers=3)
    monkeypatch.setenv("DDO_PIN_CPU_WORKERS", "7")
    s = ddo.DynamicOffloadSettings.from_env(config=config)
    assert s.config.pin_cpu_workers == 3  # an explicit config replaces preset and env
    s = ddo.DynamicOffloadSettings.from_env(env={"DDO_PIN_CPU_WORKERS": "5"})
    assert s.config.pin_cpu_workers == 5


def test_wsl_turns_pinning_off():
    s = ddo.DynamicOffloadSettings.from_env(preset="one_shot_fast", wsl=True)
    assert s.pin_requested is True and s.pin_effective is False and s.wsl is True


def test_profile_dir_and_keys(profile_dir, monkeypatch):
    assert ddo.profile_dir() == str(profile_dir)
    monkeypatch.delenv("DDO_PROFILE_DIR")
    monkeypatch.setenv("HOME", "/tmp/ddo-home-test")
    assert ddo.profile_dir() == os.path.join("/tmp/ddo-home-test", ".ddo", "profiles")
    # diffusers-dynamic-offloader's key: "ddo-capacity-v1-" and 24 hex digits of the identity's hash.
    key = ddo.profile_key("video-5s", "FluxTransformer2DModel")
    assert key.startswith("ddo-capacity-v1-") and len(key) == len("ddo-capacity-v1-") + 24
    assert key != ddo.profile_key("video-8s", "FluxTransformer2DModel")
    assert key != ddo.profile_key("video-5s", "FluxTransformer2DModel", "sdnq_runtime")
    assert ddo.profile_path("video-5s", "FluxTransformer2DModel", "/x").endswith(f"/{key}.json")


def test_public_surface_has_no_raw_extension_classes():
    # ddo._C is private: the only _C object re-exported is the error table's NotFoundError, and
    # the legacy host-context store stays behind ddo.legacy.
    raw = {name for name in ddo.__all__ if getattr(ddo, name) is getattr(_C, name, None)}
    assert raw == {"NotFoundError"}
    for name in ("ProfileStore", "HostContextStore", "normalize_context", "context_key"):
        assert not hasattr(ddo, name), name
    assert ddo.DynamicOffloadProfileSession is ddo.legacy.DynamicOffloadProfileSession
    assert ddo.load_dynamic_offload_profile is ddo.legacy.load_dynamic_offload_profile


def test_legacy_host_context_session(profile_dir):
    ctx = {"steps": 28, "model": "flux", "gpu": "4090"}
    assert list(ddo.normalize_dynamic_offload_profile_context(ctx)) == ["gpu", "model", "steps"]
    key = ddo.dynamic_offload_profile_key
    assert key(ctx) == key(dict(reversed(list(ctx.items()))))
    with pytest.raises(ValueError):
        ddo.normalize_dynamic_offload_profile_context({"x": float("nan")})
    with pytest.raises(TypeError, match="object"):
        ddo.normalize_dynamic_offload_profile_context({"x": object()})
    # diffusers-dynamic-offloader's session API (python/tests/test_compat.py compares it with the library).
    session = ddo.DynamicOffloadProfileSession(ctx, {"model": "flux", "gpu": "4090"})
    metric = {"metric": "resident_budget_gb"}
    session.record_success({"status": "success", "capacity": {**metric, "value": 6.0}},
                           recommendation={"profile_resident_module_budget_gb": 6.0})
    session.record_success({"status": "failure", "capacity": {**metric, "value": 9.0}})
    assert ddo.get_dynamic_offload_profile_recommendation(session.execution_profile) == {
        "profile_resident_module_budget_gb": 6.0
    }
    cap = ddo.get_dynamic_offload_profile_capacity(session.capacity_profile, "resident_budget_gb")
    assert cap == {"max_success": 6.0, "min_failure": 9.0}
    assert len(session.execution_profile["observations"]) == 2
    assert session.execution_path.name.startswith("ddo-capacity-v1-")
    assert str(session.execution_path.parent) == str(profile_dir)
    # Legacy contexts never show up as named profiles.
    assert ddo.list_profiles() == []


def test_settings_built_from_a_config_take_overrides_everywhere(profile_dir, monkeypatch):
    """Settings from a config report the preset "custom": an override on them (enable_offload's,
    enable_pipeline_offload's, the session's saved budget) keeps what they were built with and
    reads no environment (ddo::core::DynamicOffloadSettings::with_overrides)."""
    config = ddo.DynamicOffloadConfig(
        execution_device="sim", execution_mode="linear_runtime", max_resident_module_budget_gb=0.0
    )
    settings = ddo.DynamicOffloadSettings.from_env(config=config)
    assert settings.requested_preset == "custom"
    monkeypatch.setenv("DDO_RESIDENT_MODULE_BUDGET_GB", "1")  # not read by with_overrides
    verbose = settings.with_overrides(verbose=True)
    assert verbose.requested_preset == "custom" and verbose.config.verbose
    assert verbose.config.resident_module_budget_gb == 0.0
    assert not settings.config.verbose  # the original is unchanged
    with pytest.raises(TypeError, match="no_such_field"):
        settings.with_overrides(no_such_field=1)

    pipe = {"transformer": torch.nn.Sequential(torch.nn.Linear(64, 64)).eval()}
    offload = ddo.enable_pipeline_offload(pipe, settings=settings, verbose=True)
    assert offload.components["transformer"].settings.config.verbose
    offload.remove()

    session = ddo.DynamicOffloadProfileSession({"model": "flux"}, {"model": "flux"})
    session.record_success({"status": "success"},
                           recommendation={"profile_resident_module_budget_gb": 5.0})
    applied, recommendation = session.apply_settings(settings)
    assert recommendation == {"profile_resident_module_budget_gb": 5.0}
    assert applied.requested_preset == "custom"
    assert applied.config.resident_module_budget_gb == 5.0
    assert applied.config.execution_device == "sim"
