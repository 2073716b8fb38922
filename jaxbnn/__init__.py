"""jaxbnn: binary and ternary neural networks in JAX.

Data flow: quantizers -> layers -> models (train) -> export -> packed format -> ops -> kernels.
"""

from jaxbnn import formats, ops, reference
from jaxbnn._ffi import status as native_status

__version__ = "0.1.0"
__all__ = ["formats", "ops", "reference", "native_status"]
