"""Engine-agnostic core of vllm-av: numpy and torch only, never vllm.

The per-step pipeline (DESIGN 2): draft features -> estimator confidences ->
survival -> budget from stale scores (CPU) -> top-B selection on current
scores (device) -> lossless verification -> estimator update.
"""

from vllm_av.core.budget import size_budget
from vllm_av.core.confidence import ConfidenceHead
from vllm_av.core.cost_model import CostCurve, CostModel
from vllm_av.core.estimator import OnlineAcceptanceEstimator
from vllm_av.core.features import (
    draft_features,
    entropy,
    log_q_max,
    match_length_feature,
    top2_margin,
)
from vllm_av.core.metrics import (
    expected_calibration_error,
    log_loss,
    reliability_bins,
    roc_auc,
)
from vllm_av.core.rejection import rejection_sample, verify_block
from vllm_av.core.selector import (
    AdmittedLayout,
    admitted_layout,
    compiled_select_admitted,
    select_admitted,
)
from vllm_av.core.survival import survival

__all__ = [
    "AdmittedLayout",
    "ConfidenceHead",
    "CostCurve",
    "CostModel",
    "OnlineAcceptanceEstimator",
    "admitted_layout",
    "compiled_select_admitted",
    "draft_features",
    "entropy",
    "expected_calibration_error",
    "log_loss",
    "log_q_max",
    "match_length_feature",
    "reliability_bins",
    "rejection_sample",
    "roc_auc",
    "select_admitted",
    "size_budget",
    "survival",
    "top2_margin",
    "verify_block",
]
