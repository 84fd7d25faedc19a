"""The paged_kv custom ops; importing this registers ``torch.ops.paged_kv.write_attend`` and ``.attend``.

Call them through ``torch.ops.paged_kv``. The name ``write_attend`` here is the module (it holds the
``CHECK_VALUES`` flag), not the op.
"""

from . import write_attend
from .write_attend import VISIBILITIES, check_values, resolve_kernel, unavailable_reason, validate_inputs

__all__ = ["write_attend", "VISIBILITIES", "check_values", "resolve_kernel", "unavailable_reason", "validate_inputs"]
