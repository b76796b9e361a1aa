"""torch.distributed on two processes: on the CPU (gloo), and on two GPUs (NCCL) where
there are two.

Pipeline parallelism: offloaded stages train exactly like the same pipeline without
offloading. This is the scenario that breaks offloaders keeping state in queues: more
microbatches than stages, fraction 0, an evaluation forward before training, several
optimizer steps. FSDP2: blocks sharded with ``fully_shard`` and compiled with the offload
backend get the same gradients as compiled without it."""

from __future__ import annotations

import datetime
import os
import re
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import offload_pass
from tests import models

pipelining = pytest.importorskip("torch.distributed.pipelining")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

WORLD = 2
MICROBATCHES = 4
STEPS = 3
FRACTIONS = (0.0, 0.5, 1.0)
COLLECTIVE_TIMEOUT_S = 180
PROCESS_GROUPS = {"cpu": "gloo", "cuda": "nccl"}
# Before 2.13 a pipeline's first training step after an eval() fails in torch itself,
# with or without offloading ("has gradients None", pytorch/pytorch#182182).
EVAL_BEFORE_TRAINING = torch.__version__ >= "2.13"
TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < WORLD or not dist.is_nccl_available(),
    reason=f"needs {WORLD} CUDA devices and NCCL",
)
DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")
    ),
    pytest.param("cuda", marks=[pytest.mark.cuda, TWO_GPUS]),
]


def _device(kind: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")


def _init(kind: str, rank: int, port: int) -> torch.device:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = _device(kind, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # A rank that fails leaves the other waiting in a collective: fail it too, soon.
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(PROCESS_GROUPS[kind], rank=rank, world_size=WORLD, timeout=timeout)
    return device


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).float().pow(2).mean()


def _stage_modules(rank: int, virtual: int) -> list[torch.nn.Module]:
    """This rank's stages of a 4-block stack: stage s holds blocks s*k .. s*k+k-1."""
    torch.manual_seed(0)
    blocks = models.BlockStack(dim=32, heads=4, depth=4).blocks
    per_stage = len(blocks) // (WORLD * virtual)
    stage_ids = [rank + WORLD * v for v in range(virtual)]
    return [torch.nn.Sequential(*blocks[s * per_stage : (s + 1) * per_stage]) for s in stage_ids]


def _static_shapes(stage: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A stage's microbatch input and output, given so that the schedule needs no shape
    inference (which sends Python objects, and those need NumPy)."""
    shape = (8 // MICROBATCHES, 16, 32)
    return (
        torch.empty(shape, device=device, requires_grad=stage > 0),
        torch.empty(shape, device=device, requires_grad=True),
    )


def _train(
    rank: int, virtual: int, device: torch.device, backend
) -> tuple[list[float], list[torch.Tensor]]:
    """Evaluation forward, then STEPS optimizer steps; (losses, final parameters)."""
    modules = [m.to(device) for m in _stage_modules(rank, virtual)]
    stages = [
        pipelining.PipelineStage(
            torch.compile(m, backend=backend),
            rank + WORLD * v,
            WORLD * virtual,
            device,
            *_static_shapes(rank + WORLD * v, device),
        )
        for v, m in enumerate(modules)
    ]
    if virtual == 1:
        schedule = pipelining.Schedule1F1B(stages[0], MICROBATCHES, loss_fn=_loss)
    else:
        schedule = pipelining.ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=_loss)
    optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, 32, generator=generator).to(device)
    target = torch.randn(8, 16, 32, generator=generator).to(device)
    first, last = rank == 0, rank == WORLD - 1

    def run(step) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        kwargs = {"target": target, "losses": losses} if last else {}
        step(*args, **kwargs)
        return losses

    if EVAL_BEFORE_TRAINING:
        run(schedule.eval)
    recorded = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        recorded += [loss.item() for loss in run(schedule.step)]
        optimizer.step()
    return recorded, [p.detach().cpu() for m in modules for p in m.parameters()]


def _worker(rank: int, kind: str, port: int, virtual: int, out: str) -> None:
    device = _init(kind, rank, port)
    try:
        torch.compiler.reset()
        reference = _train(rank, virtual, device, "aot_eager")
        results = {}
        for fraction in FRACTIONS:
            torch.compiler.reset()
            backend = offload_pass.backend(fraction=fraction, min_bytes=0, compiler="eager")
            trained = _train(rank, virtual, device, backend)
            results[fraction] = (trained, sum(len(plan.moved) for plan in backend.plans))
        torch.save({"reference": reference, "offloaded": results}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("virtual", [1, 2], ids=["1f1b", "interleaved-1f1b"])
def test_offloaded_pipeline_trains_like_the_plain_one(virtual, kind, tmp_path):
    args = (kind, _free_port(), virtual, str(tmp_path))
    mp.spawn(_worker, args=args, nprocs=WORLD, join=True)
    for rank in range(WORLD):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        (losses, params) = saved["reference"]
        if rank == WORLD - 1:
            assert len(losses) == STEPS * MICROBATCHES
        for fraction, ((got_losses, got_params), moved) in saved["offloaded"].items():
            assert (moved > 0) == (fraction > 0), (rank, fraction, moved)
            assert got_losses == losses, (rank, fraction)
            for got, expected in zip(got_params, params, strict=True):
                assert torch.equal(got, expected), (rank, fraction)


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")
def test_pipeline_example_runs_under_torchrun(tmp_path):
    import json
    import subprocess
    import sys

    options = "--device cpu --dim 128 --heads 4 --seq 512 --layers 4 --batch 4"
    options += f" --microbatches 4 --steps 1 --fraction 1.0 --trace-dir {tmp_path}"
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
        *("--master-port", str(_free_port()), "examples/pipeline_parallel.py"),
        *options.split(),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    # the two ranks print to one pipe: a line of one may run on into the other's
    records = re.findall(
        r"rank \d 1f1b (no offload|offload) *: .*?moved per microbatch +([\d.]+)", done.stdout
    )
    assert len(records) == 4
    assert all(float(moved) > 0 for kind, moved in records if kind == "offload")
    traces = sorted(p.name for p in tmp_path.glob("*.json"))
    assert traces == [f"rank{r}-{b}.json" for r in (0, 1) for b in ("no-offload", "offload")]
    events = json.loads((tmp_path / "rank0-offload.json").read_text())["traceEvents"]
    assert any(e.get("name") == "offload_pass::offload" for e in events)


def _fsdp_gradients(rank: int, device: torch.device, backend) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = models.BlockStack(dim=64, heads=4, depth=3).to(device)
    mesh = init_device_mesh(device.type, (WORLD,))
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh)
        model.blocks[i] = torch.compile(block, backend=backend)
    fully_shard(model, mesh=mesh)
    x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(rank)).to(device)
    for _ in range(2):  # gradients accumulate over two steps
        model(x).float().pow(2).mean().backward()
    return [p.grad.to_local().cpu() for p in model.parameters()]


def _fsdp_worker(rank: int, kind: str, port: int, out: str) -> None:
    device = _init(kind, rank, port)
    try:
        torch.compiler.reset()
        reference = _fsdp_gradients(rank, device, "aot_eager")
        torch.compiler.reset()
        backend = offload_pass.backend(fraction=1.0, min_bytes=0, compiler="eager")
        offloaded = _fsdp_gradients(rank, device, backend)
        moved = sum(len(plan.moved) for plan in backend.plans)
        torch.save(
            {"reference": reference, "offloaded": offloaded, "moved": moved}, f"{out}/rank{rank}.pt"
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", DEVICES)
def test_fsdp2_sharded_compiled_blocks_get_the_same_gradients(kind, tmp_path):
    pytest.importorskip("torch.distributed.fsdp", reason="needs FSDP2")
    mp.spawn(_fsdp_worker, args=(kind, _free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["moved"] > 0
        for got, expected in zip(saved["offloaded"], saved["reference"], strict=True):
            assert torch.equal(got, expected), rank


def _calibration_worker(rank: int, port: int, out: str) -> None:
    from offload_pass.calibration import calibrate_shared

    _init("cuda", rank, port)
    try:
        torch.save(calibrate_shared(), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@TWO_GPUS
def test_shared_calibration_gives_every_rank_the_slowest_bandwidths(tmp_path):
    from offload_pass.profiles import built_in_for_name

    mp.spawn(_calibration_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    profiles = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    assert profiles[0] == profiles[1]
    shared = profiles[0]
    assert shared.name.endswith(f"shared by {WORLD} ranks")
    base = built_in_for_name(torch.cuda.get_device_name(0))
    if base is not None:
        assert shared.matmul_flops == base.matmul_flops


def test_shared_calibration_needs_a_process_group():
    from offload_pass.calibration import calibrate_shared

    with pytest.raises(RuntimeError, match="collective: call init_process_group first"):
        calibrate_shared()
