"""What a closed-form upload's tensors are, declared by the method that makes them: what postprocessors read.

A postprocessor that treats an upload's parts differently (differential
privacy's sensitivity of each tensor, noise on the class counts) reads
:attr:`fedray.Upload.parts` (in an aggregate hook, :attr:`fedray.UploadContext.parts`),
never a method's field names. The method declares them
(:meth:`fedray.ClosedFormMethod.upload_parts`), by the tensors' paths in the
upload (:func:`~fedray.methods.postprocessor.flatten`: ``sums``,
``blocks.0.means``). The default, :class:`UploadParts` with nothing declared,
says only that every tensor is a sum over the client's samples: right for a
method that only sums, and a postprocessor that needs more refuses it in one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SampleSum:
    """A tensor that is a sum over the client's samples, each sample (features z of width d, label y) adding its
    ``degree``-th power in z: 0 its one-hot label e_y (class counts), 1 z (times e_y: class sums, ZᵀY), 2 zzᵀ or z∘z
    (ZᵀZ, per-class squares); None where the method does not say.

    ``by_class``: its first axis is the class (row c sums the samples of class c); ``symmetric``: a symmetric matrix
    (ZᵀZ), each client's exactly, entry for entry (a sum through an entrywise postprocessor maps and adds only its
    distinct entries: :mod:`fedray.runtime.compact_sum`); ``width_axis``: its axis of length d, the width of the
    features it sums (None: none); ``class_axis``: an axis other than the first that indexes the class (Fed3R's ZᵀY,
    d × C: axis 1), along which a client's sum is zero outside the classes it holds (None: none but the first, where
    ``by_class``)."""

    degree: int | None = None
    by_class: bool = False
    symmetric: bool = False
    width_axis: int | None = None
    class_axis: int | None = None

    @property
    def axis_of_classes(self) -> int | None:
        """The axis indexing the class (0 where ``by_class``), outside whose held classes a client's sum is zero."""
        return 0 if self.by_class else self.class_axis


@dataclass(frozen=True)
class ClientRows:
    """Rows a client sends side by side, which the server sees one by one and never adds (FedCOF's (class, count, mean)
    for each class it holds): the paths of their ``classes`` (int64), ``counts`` (the samples behind each row) and
    ``means`` (rows × d), and ``per_class``, the tensor counting the rows of each class (FedCOF's ``received``)."""

    classes: str
    counts: str
    means: str
    per_class: str

    @property
    def names(self) -> frozenset[str]:
        return frozenset({self.classes, self.counts, self.means, self.per_class})


@dataclass(frozen=True)
class UploadParts:
    """A closed-form upload's parts: its sums over samples by path (:class:`SampleSum`; a tensor not named here is a sum
    over samples of undeclared degree) and its per-client ``rows`` (:class:`ClientRows`), if any.

    A server's sum of uploads has the same parts, less what stays in the shards (FedCOF's rows): where ``rows`` is set,
    the other tensors of a sum are the totals of the released rows."""

    sums: Mapping[str, SampleSum] = field(default_factory=dict)
    rows: ClientRows | None = None

    def of(self, name: str) -> SampleSum:
        """What the tensor at ``name`` sums (undeclared: a sum over samples of unknown degree)."""
        return self.sums.get(name, SampleSum())

    def named(self, degree: int) -> str | None:
        """The path of the by-class sum of ``degree`` (0: the class counts, 1: the class sums of the features), if any."""
        return next((name for name, part in self.sums.items() if part.by_class and part.degree == degree), None)
