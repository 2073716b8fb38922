"""jaxbnn: binary and ternary neural networks in JAX.

Data flow: quantizers -> layers -> models (train) -> export -> packed format -> ops -> kernels.
`import jaxbnn` loads the inference core (formats, reference, ops and the native handlers); the Flax side
(quantizers, layers, models, summary) and the runtime load on first use.
"""

import importlib
import pathlib
import warnings

from jaxbnn import _ffi, formats, ops, reference
from jaxbnn._ffi import NativeKernelsWarning
from jaxbnn._ffi import status as native_status

__version__ = "0.1.0"


def _warn_without_cpu_kernels() -> None:
    """Say once, at import, that the CPU module is missing: every op would silently run the pure-JAX
    reference. The usual cause is importing the source tree (a script run from the clone's root)."""
    problem = _ffi.status().get("cpu", "")
    if "not importable" not in problem:
        return
    package = pathlib.Path(__file__).parent
    if (package.parent / "pyproject.toml").is_file() and (package.parent / "xla_ffi").is_dir():
        message = (f"jaxbnn is imported from its source tree ({package.parent}), where the native modules are "
                   f"not built ({problem}): every op runs the slow pure-JAX reference, and jaxbnn.train and "
                   "jaxbnn.export do not exist. Install jaxbnn (pip install .) and run from another folder, or "
                   "develop in an editable install (pip install -e .; README, 'Develop').")
    else:
        message = (f"jaxbnn's CPU kernels are missing from {package} ({problem}): every op runs the slow "
                   "pure-JAX reference. Reinstall jaxbnn (pip install --force-reinstall --no-deps jaxbnn, or "
                   "pip install . from its source tree).")
    warnings.warn(message, NativeKernelsWarning)


_warn_without_cpu_kernels()

_LAZY = {
    "quantizers": ("jaxbnn.quantizers", None),
    "layers": ("jaxbnn.layers", None),
    "models": ("jaxbnn.models", None),
    "summary": ("jaxbnn.summary", None),
    "runtime": ("jaxbnn.runtime", None),
    "packed_model": ("jaxbnn.packed_model", None),
    "load": ("jaxbnn.runtime", "load"),
    "PackedNet": ("jaxbnn.runtime", "PackedNet"),
    "InputRangeWarning": ("jaxbnn.runtime", "InputRangeWarning"),
    "PackedModelError": ("jaxbnn.packed_model", "PackedModelError"),
    **{
        name: ("jaxbnn.quantizers", name)
        for name in ("sign_ste", "approx_sign", "swish_sign", "ste_heaviside", "hard_tanh", "ternarize_ste",
                     "twn_thresholds", "xnor_weight_scale", "get_quantizer", "QUANTIZERS")
    },  # fmt: skip
    **{
        name: ("jaxbnn.layers", name)
        for name in ("BinaryLinear", "BinaryConv", "binary_dot_general", "binary_conv_general_dilated",
                     "make_binary_dot_general", "make_binary_conv_general_dilated", "clip_latent_weights",
                     "MODES")
    },  # fmt: skip
    **{name: ("jaxbnn.models", name) for name in ("build_model", "MODEL_BUILDERS")},
    **{name: ("jaxbnn.summary", name) for name in ("model_summary", "print_summary")},
}

__all__ = ["formats", "ops", "reference", "native_status", "NativeKernelsWarning", *_LAZY]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'jaxbnn' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value
