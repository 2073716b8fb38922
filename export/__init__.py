"""The jaxbnn exporter (ships as ``jaxbnn.export``): trained BinaryNet -> packed checkpoint (`.jbnn`).

    from jaxbnn.export import export_model, save_packed
    packed = export_model(model, target="cpu")      # bn + sign folded into thresholds, FSB-packed weights
    save_packed("model.jbnn", packed)               # atomic; jaxbnn.load("model.jbnn") runs it

Threshold rule: jaxbnn.thresholds; graph and file format: docs/export.md. Imports only the jaxbnn core.
"""

from jaxbnn.packed_model import save as save_packed

from .exporter import ExportError, bn_chain, export_model
from .report import SizeRow, fidelity_report, format_size_report, size_report

__all__ = [
    "ExportError",
    "export_model",
    "save_packed",
    "bn_chain",
    "SizeRow",
    "size_report",
    "format_size_report",
    "fidelity_report",
]
