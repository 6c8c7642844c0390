"""The closed-form methods: built-ins by name, a researcher's own by ``module:Class`` or ``file.py:Class``."""

from fedray.methods.base import ClosedFormMethod
from fedray.methods.ccvr import CCVR
from fedray.methods.fedcof import FedCOF, FedCOFOracle
from fedray.methods.ncm import FedNCM
from fedray.methods.ridge import Fed3R, Fed3RRandomFeatures, FastFederatedCalibration
from fedray.core.plugins import load_class

METHODS: dict[str, type[ClosedFormMethod]] = {
    cls.name: cls for cls in (FedNCM, Fed3R, Fed3RRandomFeatures, FedCOF, FedCOFOracle, CCVR,
                FastFederatedCalibration)
}


def method_class(spec: str) -> type[ClosedFormMethod]:
    """The closed-form method ``spec`` names: a built-in, ``module:Class`` or ``path/to/file.py:Class``."""
    return load_class(spec, ClosedFormMethod, METHODS, "closed-form method")
