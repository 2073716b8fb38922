"""The installed package: the native CPU module is built and registered, and the top-level train/ and
export/ folders ship inside it as jaxbnn.train and jaxbnn.export; imported from a source tree without its
native modules, jaxbnn says so."""

import importlib
import json
import pathlib
import shutil
import subprocess
import sys
from importlib import metadata

import pytest

import jaxbnn
from jaxbnn import _ffi

REPOSITORY = pathlib.Path(__file__).parents[1]

TARGETS = [f"jaxbnn_{op}_{kind}" for op in ("bmm", "bconv2d") for kind in ("i32", "f32", "bits")] + [
    f"jaxbnn_bmm_chain_{kind}" for kind in ("f32", "bits")] + [
    f"jaxbnn_bconv2d_residual_{kind}" for kind in ("i32", "bits", "i16", "i16_bits")] + [
    f"jaxbnn_image_conv2d_{kind}" for kind in ("i32", "i16", "bits", "i32_bits", "i16_bits")] + [
    "jaxbnn_global_sum_bits"] + [
    f"jaxbnn_{mode}_{op}_{kind}" for mode in ("tnn", "tbn", "btn") for op in ("bmm", "conv2d")
    for kind in ("i32", "f32", "bits")] + [
    f"jaxbnn_{mode}_conv2d_residual_{kind}" for mode in ("tnn", "tbn", "btn")
    for kind in ("i16", "i16_bits")]  # fmt: skip


def test_cpu_module_exposes_every_target_as_a_capsule():
    cpu = importlib.import_module("jaxbnn._cpu")
    registrations = cpu.registrations()
    assert sorted(registrations) == sorted(TARGETS)
    assert all(type(capsule).__name__ == "PyCapsule" for capsule in registrations.values())
    assert all(_ffi.has_target("cpu", target) for target in TARGETS), _ffi.status()


def installed_editable() -> bool:
    direct_url = metadata.distribution("jaxbnn").read_text("direct_url.json")
    return bool(direct_url) and json.loads(direct_url).get("dir_info", {}).get("editable", False)


def test_native_module_lives_in_the_package():
    cpu = importlib.import_module("jaxbnn._cpu")
    where = pathlib.Path(cpu.__file__).parent
    if installed_editable():  # the sources stay in the clone; the built module goes to the environment
        assert where.name == "jaxbnn" and where != pathlib.Path(jaxbnn.__file__).parent
    else:
        assert where == pathlib.Path(jaxbnn.__file__).parent


def import_jaxbnn_in(folder) -> subprocess.CompletedProcess:
    """`import jaxbnn` (and a few submodules) in a fresh interpreter whose working directory is `folder`,
    as a script or notebook there does; prints the file jaxbnn came from."""
    code = "import jaxbnn, jaxbnn.ops, jaxbnn.runtime; print(jaxbnn.__file__)"
    return subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=120)


def test_importing_a_source_tree_without_native_modules_says_so_once(tmp_path):
    clone = tmp_path / "clone"  # the clone as a fresh checkout has it: sources only, nothing built
    shutil.copytree(REPOSITORY / "jaxbnn", clone / "jaxbnn", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copytree(REPOSITORY / "xla_ffi", clone / "xla_ffi")
    shutil.copy(REPOSITORY / "pyproject.toml", clone)
    result = import_jaxbnn_in(clone)
    assert result.returncode == 0, result.stderr
    if not result.stdout.strip().startswith(str(clone)):
        pytest.skip(f"an editable install's import hook serves jaxbnn ahead of the working directory: "
                    f"{result.stdout.strip()}")
    assert result.stderr.count("NativeKernelsWarning: ") == 1, result.stderr
    assert (f"NativeKernelsWarning: jaxbnn is imported from its source tree ({clone}), where the native modules "
            "are not built (jaxbnn._cpu not importable") in result.stderr
    assert "Install jaxbnn (pip install .) and run from another folder, or develop in an editable install " \
           "(pip install -e .; README, 'Develop')." in result.stderr


def test_the_installed_package_imports_without_a_warning(tmp_path):
    result = import_jaxbnn_in(tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_train_and_export_ship_as_subpackages():
    for name in ("jaxbnn.train", "jaxbnn.export"):
        module = importlib.import_module(name)
        assert module.__name__ == name


def test_native_sources_format_messages_without_iostreams():
    """A module whose C++ runtime is linked statically (some toolchains do by default) shares the process
    with jaxlib's shared libstdc++; an ostream there can bind its locale half to each copy and crash, so
    the handlers build their messages with std::to_string, and the modules keep the runtime's symbols
    to themselves."""
    sources = [p for p in (REPOSITORY / "xla_ffi").rglob("*") if p.suffix in {".h", ".cc", ".cu", ".cuh"}]
    assert sources
    offending = [str(p.relative_to(REPOSITORY)) for p in sources
                 if any(s in p.read_text() for s in ("<sstream>", "<iostream>", "<ostream>", "ostringstream"))]
    assert offending == []
    for module in ("cpu", "cuda"):
        assert "--exclude-libs,ALL" in (REPOSITORY / "xla_ffi" / module / "CMakeLists.txt").read_text()
