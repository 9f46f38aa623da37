"""Where the memory of a training step goes, and which combination of techniques fits."""

from ..train._make_step import SHARDS as SHARDS
from ._candidates import BudgetError as BudgetError, Candidate as Candidate, Plan as Plan
from ._cost import (
    THROUGHPUTS as THROUGHPUTS,
    Cost as Cost,
    Throughput as Throughput,
    jaxpr_cost as jaxpr_cost,
    relative_time as relative_time,
)
from ._plan import ACCUMULATES as ACCUMULATES, PRECISIONS as PRECISIONS, plan as plan
from ._plot import plot_plan as plot_plan, plot_report as plot_report
from ._report import memory_report as memory_report
from ._residuals import (
    Residual as Residual,
    residual_bytes as residual_bytes,
    saved_residuals as saved_residuals,
)
from ._result import (
    PART_LABELS as PART_LABELS,
    PARTS as PARTS,
    ActivationGroup as ActivationGroup,
    MemoryReport as MemoryReport,
)
from ._target import Target as Target
from ._units import format_bytes as format_bytes, parse_size as parse_size
