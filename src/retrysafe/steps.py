"""Multi-step operations with recovery points: see docs/steps.md."""

from __future__ import annotations

from ._steps import Run, StepResultError, Workflow

__all__ = ["Run", "StepResultError", "Workflow"]
