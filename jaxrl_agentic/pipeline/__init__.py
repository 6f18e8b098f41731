"""One pipeline step, as data flows: rollout → advantages → samples → learner updates.

:class:`Pipeline` (``pipeline.py``) holds the run's long-lived pieces and makes the steps;
``batch_filters.py`` holds DAPO's filters and the collapse diagnostics it applies,
``samples.py`` builds the samples of per-token estimators, ``distillation.py`` adds a
teacher's per-token judgement to them (on-policy distillation), ``metrics.py`` the episode
metrics, ``run_checks.py`` what a run checks before it trains.
"""

from jaxrl_agentic.pipeline.metrics import trajectory_metrics
from jaxrl_agentic.pipeline.pipeline import Pipeline
from jaxrl_agentic.pipeline.run_checks import check_same_model_everywhere, model_files_digest
from jaxrl_agentic.pipeline.samples import token_estimator_samples

__all__ = [
    "Pipeline",
    "check_same_model_everywhere",
    "model_files_digest",
    "token_estimator_samples",
    "trajectory_metrics",
]
