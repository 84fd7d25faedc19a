"""Typed errors. Every message names the problem and the fix; raising one leaves state unchanged."""


class PagedKVError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(PagedKVError, ValueError):
    """Impossible geometry or options: nothing was allocated."""


class OpInputError(PagedKVError, ValueError):
    """`paged_kv::write_attend` got inputs that violate its contract."""


class KernelUnavailableError(PagedKVError, RuntimeError):
    """The requested kernel cannot run here (missing package, device or page-size rule)."""


class CapacityError(PagedKVError, RuntimeError):
    """Admission refused: the pool cannot hold what was asked. State is unchanged."""


class RequestError(PagedKVError, KeyError):
    """Unknown, finished, reused or closed request/session ids, or a forward that does not fit."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class BindingError(PagedKVError, RuntimeError):
    """A compiled attention site could not be tied to exactly one bound layer."""


class PassError(PagedKVError, RuntimeError):
    """A KV-cache attention site could not be rewritten (strict mode) or a stand-in is still read."""


class CaptureError(PagedKVError, RuntimeError):
    """Warm-up or capture is impossible as asked, or a block call does not match what was captured."""


class DivergenceError(PagedKVError, RuntimeError):
    """Ranks that must make the same decisions did not (different calls, owners or block tables): raised on every
    rank before anything is computed (distributed/agreement.py)."""


class RankFaultError(PagedKVError, RuntimeError):
    """Another rank of the model-parallel group failed inside this forward; it was rolled back here too."""
