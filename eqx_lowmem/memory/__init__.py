"""Where the memory of a training step goes, and which combination of techniques fits."""

from .._deprecated import moved as _moved
from ._candidates import BudgetError as BudgetError, Plan as Plan
from ._plan import plan as plan
from ._plot import plot_plan as plot_plan, plot_report as plot_report
from ._report import memory_report as memory_report
from ._residuals import (
    saved_residuals as saved_residuals,
)
from ._result import (
    MemoryReport as MemoryReport,
)
from ._target import Target as Target

__getattr__ = _moved(
    __name__,
    {
        "ACCUMULATES": "_plan",
        "ActivationGroup": "_result",
        "Candidate": "_candidates",
        "Cost": "_cost",
        "PARTS": "_result",
        "PART_LABELS": "_result",
        "PRECISIONS": "_plan",
        "Residual": "_residuals",
        "SHARDS": "_candidates",
        "THROUGHPUTS": "_cost",
        "Throughput": "_cost",
        "format_bytes": "_units",
        "jaxpr_cost": "_cost",
        "parse_size": "_units",
        "relative_time": "_cost",
        "residual_bytes": "_residuals",
    },
)
