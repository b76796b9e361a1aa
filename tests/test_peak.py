"""The peak breakdown: replaying the allocator's events names what is live at the peak."""

from __future__ import annotations

import pytest
import torch

from offload_pass import peak

TORCH = "/site/torch"


def _frames(*files: str) -> list[dict]:
    return [{"filename": f, "line": 7, "name": "call"} for f in files]


def _alloc(addr: int, size: int, *files: str) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": _frames(*files)}


def _free(addr: int, size: int) -> dict:
    return {"action": "free_requested", "addr": addr, "size": size, "frames": []}


def test_the_live_blocks_at_the_highest_total_are_reported_by_site():
    trace = [
        _alloc(1, 100, f"{TORCH}/nn/functional.py", "/tmp/torchinductor/a.py"),
        _alloc(2, 50, "/work/model.py"),
        _free(1, 100),
        _alloc(3, 200, "/tmp/torchinductor/a.py"),
        _alloc(4, 10, "/work/model.py"),
        _free(3, 200),
        _alloc(5, 120, "/work/model.py"),
    ]
    breakdown = peak.breakdown_from_trace(trace, before_bytes=1000, torch_dir=TORCH)
    assert breakdown.peak_bytes == 1000 + 50 + 200 + 10
    assert [(s.where, s.nbytes, s.blocks) for s in breakdown.sites] == [
        ("/tmp/torchinductor/a.py:7 call", 200, 1),
        ("/work/model.py:7 call", 60, 2),
    ]
    assert breakdown.reached_at == "/work/model.py:7 call"
    assert "peak" in str(breakdown) and "/tmp/torchinductor/a.py:7" in str(breakdown)


def test_frees_of_blocks_from_before_the_step_are_ignored():
    trace = [_free(9, 500), _alloc(1, 100, "/work/model.py")]
    breakdown = peak.breakdown_from_trace(trace, before_bytes=800, torch_dir=TORCH)
    assert breakdown.peak_bytes == 900


def test_a_block_stops_counting_when_its_free_is_requested():
    completed = {"action": "free_completed", "addr": 1, "size": 100, "frames": []}
    trace = [_alloc(1, 100, "/work/a.py"), _free(1, 100), completed, _alloc(2, 30, "/work/b.py")]
    breakdown = peak.breakdown_from_trace(trace, before_bytes=0, torch_dir=TORCH)
    assert breakdown.peak_bytes == 100
    assert [s.where for s in breakdown.sites] == ["/work/a.py:7 call"]


def test_a_step_that_allocates_nothing_peaks_at_what_was_there():
    breakdown = peak.breakdown_from_trace([], before_bytes=64, torch_dir=TORCH)
    assert (breakdown.peak_bytes, breakdown.sites, breakdown.reached_at) == (
        64,
        (),
        "before the step",
    )


def test_frames_inside_torch_only_are_named_as_such():
    assert peak.allocation_site(_frames(f"{TORCH}/a.py"), TORCH) == "torch internals"


def test_without_cuda_it_says_it_needs_a_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA"):
        peak.peak_breakdown(lambda: None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_breakdown_peak_is_the_allocator_peak():
    kept = torch.randn(2**20, device="cuda")

    def step() -> None:
        a = torch.randn(2**22, device="cuda")
        b = a * 2
        del a
        (b @ torch.ones(2**22, device="cuda")).item()

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    breakdown = peak.peak_breakdown(step)
    # The trace holds requested sizes, the allocator's counters rounded block sizes.
    assert abs(breakdown.peak_bytes - torch.cuda.max_memory_allocated()) < 2**20
    assert breakdown.before_bytes >= kept.numel() * 4
    assert any("test_peak.py" in s.where for s in breakdown.sites)


def test_each_site_shows_its_line_of_code():
    import inspect

    line = inspect.currentframe().f_lineno + 1
    frames = [{"filename": __file__, "line": line, "name": "test"}]  # the allocating line
    breakdown = peak.breakdown_from_trace(
        [{"action": "alloc", "addr": 1, "size": 8, "frames": frames}], 0, TORCH
    )
    assert breakdown.sites[0].code.endswith("# the allocating line")
