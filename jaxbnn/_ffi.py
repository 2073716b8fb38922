"""Registration of the native XLA FFI handlers (the `jaxbnn._cpu` and `jaxbnn._cuda` nanobind modules).

Each module exposes `registrations()`: target name -> PyCapsule. A module that is missing (a build without
CUDA) or fails to import leaves its platform to the pure-JAX reference; `status()` says why.
"""

from __future__ import annotations

import importlib

import jax

# jax platform name (as in lax.platform_dependent) -> (module, XLA platform name for registration)
_MODULES = {"cpu": ("jaxbnn._cpu", "cpu"), "cuda": ("jaxbnn._cuda", "CUDA")}
class NativeKernelsWarning(RuntimeWarning):
    """The native CPU module is missing: the ops run the pure-JAX reference (correct, much slower)."""


_registered: dict[str, set[str]] = {}
_problems: dict[str, str] = {}


def _register_all() -> None:
    for platform, (module_name, xla_platform) in _MODULES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            _problems[platform] = f"{module_name} not importable: {err}"
            continue
        targets = set()
        for name, capsule in module.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=xla_platform)
            targets.add(name)
        _registered[platform] = targets


def has_target(platform: str, target: str) -> bool:
    """Whether a native handler for `target` is registered for jax platform `platform` ("cpu", "cuda")."""
    return target in _registered.get(platform, ())


def status() -> dict[str, str]:
    """Per platform: which native targets are registered, or why none are."""
    out = {p: f"{len(t)} targets: {', '.join(sorted(t))}" for p, t in _registered.items()}
    out.update(_problems)
    return out


_register_all()
