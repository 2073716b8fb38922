"""The installed package: the native CPU module is built and registered, and the top-level train/ and
export/ folders ship inside it as jaxbnn.train and jaxbnn.export."""

import importlib
import pathlib

import jaxbnn
from jaxbnn import _ffi

TARGETS = [f"jaxbnn_{op}_{kind}" for op in ("bmm", "bconv2d") for kind in ("i32", "f32", "bits")]


def test_cpu_module_exposes_every_target_as_a_capsule():
    cpu = importlib.import_module("jaxbnn._cpu")
    registrations = cpu.registrations()
    assert sorted(registrations) == sorted(TARGETS)
    assert all(type(capsule).__name__ == "PyCapsule" for capsule in registrations.values())
    assert all(_ffi.has_target("cpu", target) for target in TARGETS), _ffi.status()


def test_native_module_lives_in_the_package():
    cpu = importlib.import_module("jaxbnn._cpu")
    assert pathlib.Path(cpu.__file__).parent == pathlib.Path(jaxbnn.__file__).parent


def test_train_and_export_ship_as_subpackages():
    for name in ("jaxbnn.train", "jaxbnn.export"):
        module = importlib.import_module(name)
        assert module.__name__ == name
