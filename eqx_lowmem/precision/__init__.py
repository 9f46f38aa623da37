"""Low precision: dtype policies, dynamic loss scaling, 16-bit parameters, 16- and 8-bit state."""

from ._loss_scale import (
    DynamicLossScale as DynamicLossScale,
    all_finite as all_finite,
    dynamic_loss_scale as dynamic_loss_scale,
)
from ._optim import HalfState as HalfState, half_state as half_state
from ._policy import (
    PRESETS as PRESETS,
    Policy as Policy,
    cast_floating as cast_floating,
    get_policy as get_policy,
)
from ._quantized import (
    QuantizedArray as QuantizedArray,
    QuantizedState as QuantizedState,
    dynamic_code as dynamic_code,
    quantized_state as quantized_state,
)
from ._rounding import (
    stochastic_round as stochastic_round,
    stochastic_round_tree as stochastic_round_tree,
)
