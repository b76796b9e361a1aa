"""offload_pass: a torch.compile backend that moves saved activations to host memory.

model = torch.compile(model, backend=offload_pass.backend(fraction=0.5))

Before ``transformers.Trainer`` or ``accelerate``: ``model.compile(backend=...)`` in place, or
:func:`compile_regions`; :func:`register_backend` names an option set.
"""

from offload_pass import ops  # noqa: F401  (registers the offload_pass:: ops)
from offload_pass._compat import register_backend_name
from offload_pass.backend import OffloadBackend, backend, default_backend, offload
from offload_pass.calibration import calibrate_shared
from offload_pass.explain import explain
from offload_pass.fit import BudgetFit, BudgetTrial, cuda_peak, fit_memory_budget
from offload_pass.integrations import compile_regions, register_backend
from offload_pass.options import OffloadOptions, set_fraction
from offload_pass.peak import PeakBreakdown, peak_breakdown
from offload_pass.plan import Plan
from offload_pass.planner import Decision
from offload_pass.profiles import DeviceProfile, HostScale
from offload_pass.report import ModelReport
from offload_pass.runtime import OffloadError, TransferCounts, counts
from offload_pass.simulate import CopyPrediction, Prediction, Transfer

register_backend_name("offload", offload)

__all__ = [
    "BudgetFit",
    "BudgetTrial",
    "CopyPrediction",
    "Decision",
    "ModelReport",
    "DeviceProfile",
    "HostScale",
    "OffloadBackend",
    "OffloadError",
    "OffloadOptions",
    "PeakBreakdown",
    "Plan",
    "Prediction",
    "Transfer",
    "TransferCounts",
    "backend",
    "calibrate_shared",
    "compile_regions",
    "counts",
    "cuda_peak",
    "default_backend",
    "explain",
    "fit_memory_budget",
    "peak_breakdown",
    "register_backend",
    "set_fraction",
]
__version__ = "0.1.0"
