"""The error table (python/src/errors.cpp): one translator for the whole of ddo._C, so the same
cause raises the same exception class with the C++ message whichever binding it came through.
Each test asserts the exact class and the message, not only that something was raised."""

import pytest
import torch

import ddo
from ddo import _C
from conftest import STREAM_ALL
from helpers import TinyNet, tiny_inputs

# ddo::Code (by the test hooks' names) -> the exact Python class.
TABLE = {
    "invalid_argument": ValueError,
    "data_loss": ValueError,
    "failed_precondition": RuntimeError,
    "unavailable": RuntimeError,
    "internal": RuntimeError,
    "not_found": ddo.NotFoundError,
    # Note [A full device is torch.OutOfMemoryError]: the class a step's full device raises.
    "resource_exhausted": torch.OutOfMemoryError,
}


@pytest.mark.parametrize("code", sorted(TABLE))
def test_each_code_raises_its_class_with_the_message(code):
    assert _C.code_of_exception(code) is TABLE[code]
    with pytest.raises(TABLE[code]) as caught:
        _C.raise_error(code, f"the {code} message")
    assert type(caught.value) is TABLE[code]
    assert str(caught.value) == f"the {code} message"


def test_not_found_is_both_file_not_found_and_key_error():
    assert issubclass(ddo.NotFoundError, FileNotFoundError)
    assert issubclass(ddo.NotFoundError, KeyError)
    assert ddo.NotFoundError is _C.NotFoundError


def test_unknown_code_names_the_codes():
    with pytest.raises(ValueError, match="unknown code 'bogus'; codes: invalid_argument"):
        _C.raise_error("bogus", "x")


@pytest.mark.parametrize(
    "kind, exc",
    [
        ("out_of_memory", torch.OutOfMemoryError),
        ("value", ValueError),
        ("type", TypeError),
        ("index", IndexError),
        ("not_implemented", NotImplementedError),
        ("error", RuntimeError),
    ],
)
def test_c10_errors_raise_the_class_torch_gives_them(kind, exc):
    with pytest.raises(exc) as caught:
        _C.raise_c10_error(kind, f"c10 {kind} message")
    assert type(caught.value) is exc
    assert "c10 " + kind + " message" in str(caught.value)
    assert "Exception raised from" not in str(caught.value)  # no C++ backtrace


def test_a_full_device_is_the_same_class_as_torch_raises_in_a_step():
    # The same cause through both paths: ddo's own setup allocation and torch's allocator.
    with pytest.raises(torch.OutOfMemoryError) as setup:
        _C.raise_error("resource_exhausted", "device full in setup")
    with pytest.raises(torch.OutOfMemoryError) as step:
        _C.raise_c10_error("out_of_memory", "device full in a step")
    assert type(setup.value) is type(step.value) is torch.OutOfMemoryError


# --- the same table on real calls -----------------------------------------------------------


def test_invalid_argument_from_settings_is_a_value_error_naming_the_variable():
    with pytest.raises(ValueError) as caught:
        ddo.DynamicOffloadSettings.from_env(env={"DDO_RESIDENT_MODULE_BUDGET_GB": "6GB"})
    assert type(caught.value) is ValueError
    assert "DDO_RESIDENT_MODULE_BUDGET_GB" in str(caught.value)
    assert "6GB" in str(caught.value)


def test_not_found_from_the_profile_store_names_the_profile(profile_dir):
    store = _C.ProfileStore(str(profile_dir))
    with pytest.raises(ddo.NotFoundError) as caught:
        store.remove("nobody-saved-this", "TinyNet")
    assert type(caught.value) is ddo.NotFoundError
    assert "no profile" in str(caught.value) and str(profile_dir) in str(caught.value)


@torch.no_grad()
def test_resource_exhausted_in_setup_is_out_of_memory_and_leaves_the_model():
    model = TinyNet().eval()
    ids = tiny_inputs()
    expected = model(ids)
    # A sim device of 1 KiB cannot hold the tiny model's resident and small tensors.
    config = {**STREAM_ALL, "small_tensor_threshold_bytes": 1 << 20, "sim_device_capacity_gb": 1e-6}
    with pytest.raises(torch.OutOfMemoryError) as caught:
        ddo.enable_offload(model, **config)
    assert type(caught.value) is torch.OutOfMemoryError
    assert "bytes" in str(caught.value)
    assert not hasattr(model, "_ddo_offload")
    assert not _C.is_managed(model.blocks[0][0].weight)
    assert torch.equal(model(ids), expected)


def test_arguments_python_cannot_hand_to_cpp_name_themselves():
    """A non-pipeline to enable_pipeline_offload and a name that is not UTF-8 text are errors that
    say what to pass, not the binding's signature or vars()'s message."""
    with pytest.raises(TypeError, match="enable_pipeline_offload takes a pipeline .* not int"):
        ddo.enable_pipeline_offload(42)
    with pytest.raises(TypeError, match="not Linear; for one model use enable_offload"):
        ddo.enable_pipeline_offload(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"profile_name='\\ud800' is not valid text"):
        ddo.enable_offload(torch.nn.Linear(4, 4), profile_name="\ud800", execution_device="sim")
    with pytest.raises(ValueError, match="more than 2\\^48 elements"):
        ddo._C.sdnq_layout_code("int8", torch.bfloat16, 2**40, 2**40, 0, False)
