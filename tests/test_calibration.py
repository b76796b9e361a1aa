"""A calibrated profile is measured once per device model and kept for the next process."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from offload_pass import calibration, device_cache
from offload_pass.profiles import BUILT_IN


@pytest.fixture
def new_process(monkeypatch, tmp_path):
    """Calibration's state as a new process on a machine with one "Test GPU" finds it."""
    monkeypatch.setenv(device_cache.CACHE_DIR_VARIABLE, str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    calibration.calibrate.cache_clear()
    yield calibration.calibrate.cache_clear
    calibration.calibrate.cache_clear()


def _not_measured(device):
    raise AssertionError("measured again, though a profile was kept")


def test_a_calibrated_profile_is_kept_for_the_next_process(new_process, monkeypatch, tmp_path):
    measured = dataclasses.replace(BUILT_IN["h200"], name="calibrated Test GPU")
    monkeypatch.setattr(calibration, "_measured_profile", lambda device: measured)
    assert calibration.calibrate(0) == measured
    (path,) = tmp_path.glob("*.json")
    assert path.name.startswith("Test_GPU-torch-")
    new_process()
    monkeypatch.setattr(calibration, "_measured_profile", _not_measured)
    assert calibration.calibrate(1) == measured, "kept per model, whichever device has it"


@pytest.mark.parametrize("other", ["a field no longer there", "a field added since"])
def test_a_kept_profile_of_other_fields_is_measured_again(new_process, monkeypatch, other):
    path = device_cache.path_for(torch.device("cuda", 0))
    fields = dataclasses.asdict(BUILT_IN["h200"])
    if other == "a field no longer there":
        fields[other] = 1.0
    else:
        del fields["kernel_floor_seconds"]
    path.write_text(json.dumps({calibration.CALIBRATED_PROFILE: {calibration.MEASURED: fields}}))
    measured = dataclasses.replace(BUILT_IN["h100"], name="calibrated Test GPU")
    monkeypatch.setattr(calibration, "_measured_profile", lambda device: measured)
    assert calibration.calibrate(0) == measured
    kept = json.loads(path.read_text())[calibration.CALIBRATED_PROFILE][calibration.MEASURED]
    assert kept == dataclasses.asdict(measured)
