"""What the engine receives from a method, an algorithm, a server optimizer or a postprocessor, checked where it arrives.

A plugin's wrong output (a classifier of the wrong shape, a bare tensor from
``solve``, a server step that drops parameters, a state that checkpoints cannot
hold) otherwise fails far from its cause, or not at all: a NaN classifier
scores accuracy 0 in a "complete" run, a step returning ``{}`` never moves the
model. Each check here raises a one-line :class:`FedrayError` naming the class
(a plugin by its spec), the method that returned the value and what was
expected, and costs only a look at names and shapes (the classifier's
finiteness: one pass over a d × C matrix per evaluation).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from numbers import Real
from typing import Any, NoReturn

from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module
from fedray.methods.algorithm import FederatedAlgorithm, Params, Upload
from fedray.methods.base import Classifier
from fedray.core.plugins import plugin_spec

torch = lazy_module("torch", globals())


def owner(obj: object) -> str:
    """How an error names the class of ``obj``: ``the plugin /home/me/my_ncm.py:MyNCM``, ``fedray's fed3r``."""
    cls = type(obj)
    spec = plugin_spec(cls)
    return f"the plugin {spec}" if spec is not None else f"fedray's {getattr(cls, 'name', '') or cls.__name__}"


def _refuse(obj: object, method: str, got: str, expected: str) -> NoReturn:
    raise FedrayError(f"{owner(obj)}: {method} returned {got}; expected {expected}")


def _what(value: object) -> str:
    """``value`` in a few words: ``None``, ``a Tensor of shape (8, 6)``, ``a dict``."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {_shape(value.shape)}"
    if isinstance(value, dict) and not value:
        return "an empty dict"
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _shape(shape: tuple[int, ...] | torch.Size) -> str:
    return f"({shape[0]},)" if len(shape) == 1 else str(tuple(shape))


def _names(names: Any) -> str:
    return ", ".join(sorted(names)) or "none"


# --- closed-form methods


def check_classifier(method: object, classifier: object, width: int, num_classes: int, after_round: int,
                     statistics: Callable[[], bool]) -> Classifier:
    """``solve``'s classifier: a :class:`Classifier` whose weight is (``width``, ``num_classes``) (``width``: the
    features after the method's transform), whose bias is None or (``num_classes``,), all finite; ``statistics()``
    says whether the statistics it was solved from are finite (asked only when the classifier is not)."""
    expected = f"a fedray.Classifier with a ({width}, {num_classes}) weight (features × classes)"
    where = f" after round {after_round}"
    if not isinstance(classifier, Classifier):
        _refuse(method, "solve", _what(classifier) + where, expected)
    weight, bias = classifier.weight, classifier.bias
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (width, num_classes):
        _refuse(method, "solve", f"a classifier whose weight is {_what(weight)}{where}", expected)
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (num_classes,)):
        _refuse(method, "solve", f"a classifier whose bias is {_what(bias)}{where}", f"no bias or one of shape ({num_classes},)")
    bad = [name for name, tensor in (("weight", weight), ("bias", bias)) if tensor is not None and not bool(tensor.isfinite().all())]
    if bad:
        source = "its statistics are finite" if statistics() else \
            "its statistics already hold NaN or inf: from client_statistics or combine"
        _refuse(method, "solve", f"a classifier with NaN or inf in its {' and '.join(bad)}{where} ({source})",
                "finite values")
    return classifier


def statistics_finite(statistics: object) -> bool:
    """Whether every tensor in ``statistics`` (tensors in dataclasses, dicts, lists, tuples) is finite."""
    return all(bool(tensor.isfinite().all()) for tensor in _tensors(statistics, "") if tensor.is_floating_point())


def _tensors(value: object, path: str, lists: bool = True) -> list[torch.Tensor]:
    return list(_fixed_shapes(value, path, lists, tensors=True).values())


def _fixed_shapes(value: object, path: str, lists: bool = False, tensors: bool = False) -> dict[str, Any]:
    """The tensors of ``value`` by path (``sums``, ``0``), their shapes unless ``tensors``; inside lists only with
    ``lists`` (a list may grow with the clients, as FedCOF's received means)."""
    if isinstance(value, torch.Tensor):
        return {path: value if tensors else tuple(value.shape)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(field.name, getattr(value, field.name)) for field in dataclasses.fields(value)]
    elif isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, tuple) or (lists and isinstance(value, list)):
        items = list(enumerate(value))
    else:
        return {}
    out: dict[str, Any] = {}
    for key, item in items:
        out.update(_fixed_shapes(item, f"{path}.{key}" if path else str(key), lists, tensors))
    return out


def combine_checked(method: Any, a: Any, b: Any) -> Any:
    """``method.combine(a, b)`` of two statistics whose tensors (outside lists) have the same shapes, which its result
    keeps: statistics that change shape from client to client cannot be summed."""
    first, second = _fixed_shapes(a, ""), _fixed_shapes(b, "")
    if first != second:
        _refuse(method, "client_statistics", f"statistics of changing shape ({_difference(first, second)})",
                "the same shapes from every client and round (they are added; what grows with the clients goes in a "
                "list, as FedCOF's received means)")
    total = method.combine(a, b)
    combined = _fixed_shapes(total, "")
    if combined != first:
        _refuse(method, "combine", f"statistics of another shape than its arguments' ({_difference(first, combined)})",
                "the shapes of its arguments")
    return total


def _difference(first: dict[str, tuple], second: dict[str, tuple]) -> str:
    for path in sorted({*first, *second}):
        if first.get(path) != second.get(path):
            shapes = [_shape(shapes[path]) if path in shapes else "absent" for shapes in (first, second)]
            return f"{f'the tensor at {path!r}' if path else 'the tensor'} is {shapes[0]} in one and {shapes[1]} in another"
    return ""


# --- training algorithms, server optimizers, postprocessors


def check_tensors(obj: object, method: str, value: object, expected: str = "a dict of tensors by name",
                  optional: bool = False) -> Any:
    """``value`` (returned by ``obj.method``) as a dict of tensors by name (None too when ``optional``)."""
    if value is None and optional:
        return value
    if not isinstance(value, dict):
        _refuse(obj, method, _what(value), expected)
    for name, tensor in value.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            _refuse(obj, method, f"a dict holding {_what(tensor)} at {name!r}", expected)
    return value


def check_like(obj: object, method: str, value: object, like: Params, what: str) -> Params:
    """``value`` (returned by ``obj.method``) as tensors with exactly the names and shapes of ``like`` (``what`` they
    are)."""
    expected = f"{what}: a dict of tensors named {_names(like)} with their shapes"
    check_tensors(obj, method, value, expected)
    if value.keys() != like.keys():
        missing, extra = sorted(like.keys() - value.keys()), sorted(value.keys() - like.keys())
        got = "an empty dict" if not value else "tensors " + "; ".join(
            part for part in (f"without {', '.join(missing)}" if missing else "", f"with {', '.join(extra)} too" if extra else "")
            if part)
        _refuse(obj, method, got, expected)
    for name, tensor in value.items():
        if tensor.shape != like[name].shape:
            _refuse(obj, method, f"{name} of shape {_shape(tensor.shape)}", f"{what}: {name} of shape {_shape(like[name].shape)}")
    return value


def check_features(postprocessor: object, got: torch.Tensor, returned: object) -> torch.Tensor:
    """What ``postprocessor.features`` returned for the rows ``got``: finite rows of ``got``'s shape and dtype."""
    expected = f"finite {got.dtype} rows of shape {_shape(got.shape)}"
    if not isinstance(returned, torch.Tensor):
        _refuse(postprocessor, "features", _what(returned), expected)
    if returned.shape != got.shape or returned.dtype != got.dtype:
        _refuse(postprocessor, "features", f"{returned.dtype} rows of shape {_shape(returned.shape)}", expected)
    if not bool(returned.isfinite().all()):
        _refuse(postprocessor, "features", "rows with NaN or inf", expected)
    return returned


def check_selection(postprocessor: object, rows: int, returned: object, where: str) -> torch.Tensor | None:
    """What ``postprocessor.select`` returned for a client of ``rows`` samples (``where``: the round and client): None,
    or the int64 indices of the rows kept, increasing, within range, at least one."""
    expected = f"None or increasing int64 indices of the rows kept, at least one, each in [0, {rows})"
    if returned is None:
        return None
    if not isinstance(returned, torch.Tensor) or returned.dtype != torch.int64 or returned.dim() != 1:
        _refuse(postprocessor, "select", f"{_what(returned)} ({where})", expected)
    if not len(returned) or int(returned[0]) < 0 or int(returned[-1]) >= rows or bool((returned.diff() <= 0).any()):
        _refuse(postprocessor, "select", f"indices {returned.tolist()[:8]}{'...' if len(returned) > 8 else ''} ({where})",
                expected)
    return returned


SUMMED_AS_THEY_ARE = "a closed-form method's statistics are summed as they are"
"""Why a closed-form upload's weight (and the aggregate's) stays what it was: :func:`check_upload_like`'s default."""


def check_upload_like(postprocessor: object, got: Upload, returned: object, weighted: bool, where: str,
                      method: str = "client", may_drop: bool = False, kept_because: str = SUMMED_AS_THEY_ARE) -> Upload:
    """A postprocessor's ``returned`` upload for ``got`` (``where``: the round and client, in errors): a
    :class:`Upload` of tensors with exactly ``got``'s names, shapes and dtypes, finite, with a finite weight > 0 (that
    stays ``got``'s unless ``weighted``, for the reason ``kept_because`` says: a closed-form method's statistics and
    the aggregate are summed as they are); ``may_drop``: or weight 0, an upload that never reaches the server (an exact
    sum's, see :attr:`~fedray.methods.postprocessor.Postprocessor.exact_sum`)."""
    if method == "client" and not isinstance(returned, Upload):
        _refuse(postprocessor, method, f"{_what(returned)} ({where})",
                "the fedray.Upload it got, or a new one (tensors and weight)")
    upload = returned if isinstance(returned, Upload) else Upload(returned, got.weight)
    what = "the upload's tensors" if method == "client" else "the sum's tensors"
    check_like(postprocessor, method, upload.tensors, got.tensors, what)
    for name, tensor in upload.tensors.items():
        expected = got.tensors[name].dtype
        if tensor.dtype != expected:
            _refuse(postprocessor, method, f"{name} of dtype {tensor.dtype} ({where})", f"{name} of dtype {expected}, as it got")
        if tensor.is_floating_point() and not _finite(tensor) and _finite(got.tensors[name]):
            _refuse(postprocessor, method, f"{name} with NaN or inf ({where}; it got finite values)", "finite values")
    weight = upload.weight
    dropped = may_drop and weight == 0 and not isinstance(weight, bool)
    if isinstance(weight, bool) or not isinstance(weight, Real) or not (math.isfinite(weight) and weight > 0 or dropped):
        _refuse(postprocessor, method, f"an Upload of weight {weight!r} ({where})", "a finite number > 0 as its weight")
    if not weighted and weight != got.weight and not dropped:
        _refuse(postprocessor, method, f"an Upload of weight {weight!r} ({where})",
                f"weight {got.weight:g}{' or 0 (dropped)' if may_drop else ''}: {kept_because}")
    return upload


def _finite(tensor: torch.Tensor) -> bool:
    """Whether every value of a floating-point ``tensor`` is finite: its sum is, unless a value is NaN or ±inf (or
    finite values overflow, when each is looked at). The sum is one pass without an allocation; ``isfinite`` makes a
    tensor as large, for every client's upload through a postprocessor."""
    return math.isfinite(float(tensor.sum())) or bool(tensor.isfinite().all())


def check_server_update(algorithm: object, result: object, model: Params) -> tuple[Params, Params]:
    """``server_update``'s (Δ for exactly the model's parameters, the server's next state as named tensors).

    Where the algorithm keeps the default ``server_update`` (the uploads' weighted mean), a Δ of other names or shapes
    is its uploads': the error blames ``upload``.
    """
    if not (isinstance(result, tuple) and len(result) == 2):
        _refuse(algorithm, "server_update", _what(result), "(Δ, the server's next state): a pair of dicts of tensors")
    delta, state = result
    own = type(algorithm).server_update is not FederatedAlgorithm.server_update
    check_like(algorithm, "server_update" if own else "upload (averaged by the default server_update)", delta, model,
               "Δ for the model's parameters")
    check_tensors(algorithm, "server_update", state, "the server's next state as its second item: a dict of tensors by name")
    return delta, state


def check_loss(algorithm: object, loss: object) -> torch.Tensor:
    """``loss``'s value: one number as a tensor that autograd can differentiate (not a Python float, not a vector)."""
    expected = "one number as a tensor computed from the parameters (a 0-dim tensor autograd can differentiate)"
    if not isinstance(loss, torch.Tensor):
        _refuse(algorithm, "loss", _what(loss), expected)
    if loss.numel() != 1:
        _refuse(algorithm, "loss", _what(loss), expected)
    if not loss.requires_grad:
        _refuse(algorithm, "loss", "a tensor that does not depend on the parameters (no grad_fn)", expected)
    return loss


def check_upload(algorithm: object, result: object) -> tuple[Upload, Params | None]:
    """``upload``'s (a :class:`Upload` of named tensors with a finite weight > 0, the client's next state: None or
    named tensors)."""
    expected = "(fedray.Upload(tensors, weight), the client's next state or None)"
    if not (isinstance(result, tuple) and len(result) == 2):
        _refuse(algorithm, "upload", _what(result), expected)
    upload, state = result
    if not isinstance(upload, Upload):
        _refuse(algorithm, "upload", f"{_what(upload)} as its first item", expected)
    check_tensors(algorithm, "upload", upload.tensors, "fedray.Upload's tensors as a dict of tensors by name")
    weight = upload.weight
    if isinstance(weight, bool) or not isinstance(weight, Real) or not (math.isfinite(weight) and weight > 0):
        _refuse(algorithm, "upload", f"an Upload of weight {weight!r}", "a finite number > 0 as fedray.Upload's weight")
    check_tensors(algorithm, "upload", state, "the client's next state as its second item: None or a dict of tensors by name",
                  optional=True)
    return upload, state


def check_same_upload(algorithm: object, tensors: Params, sums: Params) -> None:
    """One client's uploaded ``tensors`` against the ``sums`` of the clients before it: the same names and shapes."""
    if tensors.keys() != sums.keys() or any(tensor.shape != sums[name].shape for name, tensor in tensors.items()):
        check_like(algorithm, "upload", tensors, sums, "what the other clients upload")


def check_server_step(optimizer: object, new: object, params: Params, delta: Params) -> Params:
    """``step``'s next values: exactly Δ's parameters, each with its shape."""
    return check_like(optimizer, "step", new, {name: params[name] for name in delta}, "the next values of Δ's parameters")


def check_state(obj: object, method: str, state: object, expected: str) -> None:
    """``obj.state`` after ``obj.method``: tensors in dicts by name, as checkpoints save them."""
    bad = _not_tensors(state, "")
    if bad is not None:
        path, value = bad
        raise FedrayError(f"{owner(obj)}: its state holds {_what(value)} at {path or 'the top'} after {method}; "
                          f"expected {expected} (checkpoints save it)")


def _not_tensors(value: object, path: str) -> tuple[str, object] | None:
    """The first (path, value) in nested dicts that is not a tensor, or None."""
    if isinstance(value, torch.Tensor):
        return None
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        return path, value
    for key, item in value.items():
        bad = _not_tensors(item, f"{path}.{key}" if path else key)
        if bad is not None:
            return bad
    return None
