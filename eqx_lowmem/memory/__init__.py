"""Where the memory of a training step goes."""

from ._residuals import (
    Residual as Residual,
    residual_bytes as residual_bytes,
    saved_residuals as saved_residuals,
)
