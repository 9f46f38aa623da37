"""Low precision: dtype policies, dynamic loss scaling, 16-bit parameters, 16- and 8-bit state."""

from .._deprecated import moved as _moved
from ._loss_scale import (
    DynamicLossScale as DynamicLossScale,
    dynamic_loss_scale as dynamic_loss_scale,
)
from ._optim import half_state as half_state
from ._policy import (
    Policy as Policy,
    get_policy as get_policy,
)
from ._quantized import (
    quantized_state as quantized_state,
)

__getattr__ = _moved(
    __name__,
    {
        "HalfState": "_optim",
        "PRESETS": "_policy",
        "QuantizedArray": "_quantized",
        "QuantizedState": "_quantized",
        "all_finite": "_loss_scale",
        "cast_floating": "_policy",
        "dynamic_code": "_quantized",
        "stochastic_round": "_rounding",
        "stochastic_round_tree": "_rounding",
    },
)
