"""Synthetic step streams: the demo's simple one (`basic`) and the field stream model with its named
scenarios (`field`, `scenarios`), for tests and benchmarks of the monitor end to end."""

from rlcheck.synthetic.basic import SyntheticConfig, is_spike, synthetic_batch
from rlcheck.synthetic.field import FieldConfig, FieldFault, FieldStream

__all__ = ["FieldConfig", "FieldFault", "FieldStream", "SyntheticConfig", "is_spike", "synthetic_batch"]
