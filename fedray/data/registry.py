"""Dataset specs: ``KIND:TARGET[?key=value&...]`` → :class:`Federation`.

  synthetic:NAME    a stand-in of a real split (dim, seed, feature_shift, scale, classes); with clients=K, a
                    population of K clients shaped like the split's, of any size (fedray.data.population)
  parquet:PATH      bring-your-own features (see fedray.data.parquet): a file, or a directory of parts
  features:PATH     a feature cache written by ``fedray extract`` (an entry, or a cache folder holding one)
  hsu:TRAIN_CSV     a Hsu et al. split file (test=TEST_CSV; default the test.csv beside it;
                    images=ROOT&layout=walk|gldv2 to locate its images)
  imagefolder:ROOT  ROOT/train/<class>/* and ROOT/test/<class>/* (one client unless re-split)
  FILE.py:FUNCTION  your own function returning a Federation (or MODULE:FUNCTION), called with the
                    ?key=value options its signature declares (typed by its annotations and defaults)

``memory:NAME@HASH`` is what a run records for a federation built in Python
(:meth:`Federation.from_arrays`): a name, not a spec; loading it says so.

Any spec also takes ``split=dirichlet&alpha=A&clients=K`` (Hsu et al.'s protocol as the
FedCOF and FedNCM code implements it: equal client sizes ⌊N/K⌋, leftovers dropped),
``split=dirichlet_per_class&alpha=A&clients=K`` (each class split over the clients by
Dir(α·1_K); ``min_client_size=0`` accepts clients left empty by a very small α; they are
dropped) or ``split=classes&classes_per_client=C&clients=K`` (and ``split_seed``) to
re-split its training samples among new clients; :func:`resplit` does the same to a federation in Python.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from urllib.parse import parse_qsl, urlencode

import pyarrow.compute as pc

from fedray.data import population, splitters, synthetic
from fedray.data.dataset_options import OPTION_TYPES
from fedray.data.feature_cache import find_entry
from fedray.core.federation import TRAIN, Federation
from fedray.data.hsu_csv import hsu_test_csv_beside, load_hsu_split
from fedray.data.memory import MEMORY
from fedray.data.parquet import load_parquet
from fedray.data.splitters import classes_per_client_split, dirichlet_split, hsu_dirichlet_split
from fedray.core.errors import FedrayError
from fedray.data.images.folder import load_image_folder
from fedray.data.images.index import resolve_paths
from fedray.core.numeric_options import check_numeric_option
from fedray.core.options import TYPE_NAMES, Option, function_options
from fedray.core.plugins import canonical, load_function

KINDS = ("synthetic", "parquet", "features", "hsu", "imagefolder")
PATH_KINDS = ("parquet", "features", "hsu", "imagefolder")
PATH_OPTIONS = ("test", "images")
RESPLIT_OPTIONS = ("split", "clients", "alpha", "classes_per_client", "split_seed", "min_client_size")
"""The options of a re-split, which any spec takes."""
KIND_OPTIONS = {"synthetic": ("dim", "seed", "feature_shift", "scale", "classes"), "hsu": ("test", "images", "layout"),
                "parquet": (), "features": (), "imagefolder": ()}
"""The options each kind takes besides the re-split ones."""
SPLITS = ("dirichlet", "dirichlet_per_class", "classes")
PLUGIN = "plugin"
"""The kind of a dataset function's spec (``file.py:function``, ``module:function``)."""
KNOWN = f"one of {', '.join(k + ':…' for k in KINDS)}, or your own function as path/to/file.py:function or module:function"


def parse_spec(spec: str) -> tuple[str, str, dict[str, object]]:
    """``(kind, target, options)``: a dataset function's options are strings until its signature types them."""
    kind, colon, rest = spec.partition(":")
    if kind == MEMORY and rest:
        return MEMORY, rest, {}
    if kind not in KINDS and colon and rest:
        target, _, query = spec.partition("?")
        return PLUGIN, target, dict(parse_qsl(query, keep_blank_values=True))
    if not colon or kind not in KINDS or not rest:
        raise FedrayError(f"unknown dataset {spec!r}; use {KNOWN}")
    target, _, query = rest.partition("?")
    options: dict[str, object] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in OPTION_TYPES:
            raise FedrayError(f"dataset {spec!r}: unknown option {key!r}")
        options[key] = _typed(spec, key, value)
    return kind, target, options


def _typed(spec: str, key: str, value: str) -> object:
    """A dataset option's ``value`` (text) as :data:`OPTION_TYPES` types it."""
    try:
        typed = OPTION_TYPES[key](value)
    except ValueError:
        kind = "an integer" if OPTION_TYPES[key] is int else "a number"
        raise FedrayError(f"dataset {spec!r}: option {key}={value!r} is not {kind}") from None
    check_numeric_option(f"dataset {spec!r}: option {key}", key, typed)
    return typed


def check_spec(spec: str) -> None:
    """Every check of ``spec`` that needs no data: its kind, its options and their types, what a re-split needs.

    :func:`load_federation` runs it before loading anything; a sweep runs it on every trial's dataset before Tune starts.
    A dataset function's module is imported here (its options are its signature's).
    """
    kind, target, options = parse_spec(spec)
    if kind == MEMORY:
        raise FedrayError(f"dataset {spec!r} is a federation built in Python (fedray.Federation.from_arrays or from_table): "
                          f"there is nothing to load it from; run it from Python with fedray.run(dataset=federation)")
    if kind == PLUGIN:
        options = _plugin_options(spec, _dataset_function(spec, target), options)[1]
    if _is_population(kind, options):
        population.check(target, options["clients"], options.get("scale", 1.0), options.get("feature_shift", 0.0))
        options = {k: v for k, v in options.items() if k != "clients"}
    split_options = {k: v for k, v in options.items() if k in RESPLIT_OPTIONS}
    if kind != PLUGIN:
        _no_options(spec, {k: v for k, v in options.items() if k not in split_options and k not in KIND_OPTIONS[kind]})
    if kind == "synthetic":
        synthetic.check(target, **{k: v for k, v in options.items() if k not in split_options})
    if split_options:
        _check_split(spec, split_options)


def load_federation(spec: str) -> Federation:
    """The federation ``spec`` names, remembering its canonical spec (so that any process can rebuild it).

    Features are not read here: a Parquet file's feature column is read, and
    checked, by the process that needs some of its rows (see
    :class:`fedray.data.parquet.ParquetFeatures`). A dataset function's
    federation keeps the spec it has (usually none: shards then get their rows
    through Ray's object store, and need neither the function nor its file).
    """
    check_spec(spec)
    kind, target, options = parse_spec(spec)
    if kind == PLUGIN:
        function = _dataset_function(spec, target)
        arguments, split_options = _plugin_options(spec, function, options)
        federation = _called(spec, function, arguments)
        return _resplit(spec, federation, split_options) if split_options else federation
    if _is_population(kind, options):
        return population.build(target, **options)
    split_options = {k: options.pop(k) for k in RESPLIT_OPTIONS if k in options}
    if kind == "synthetic":
        federation = synthetic.build(target, **options)
    elif kind == "parquet":
        federation = load_parquet(target)
    elif kind == "features":
        entry = find_entry(target)
        federation = load_parquet(entry.path, entry.part_files(), name=f"features:{entry.path}")
    elif kind == "imagefolder":
        federation = load_image_folder(target)
    else:
        federation = _load_hsu(target, options)
    if split_options:
        federation = _resplit(spec, federation, split_options)
    return replace(federation, spec=canonical_spec(spec))


def _is_population(kind: str, options: dict[str, object]) -> bool:
    """``synthetic:SPLIT?clients=K`` without a re-split: a population of K clients (:mod:`fedray.data.population`)."""
    return kind == "synthetic" and "clients" in options and "split" not in options


def resplit(federation: Federation, **options: object) -> Federation:
    """``federation``'s training samples re-split among new clients, as a spec's ``?split=...`` options do
    (``split="dirichlet", alpha=0.1, clients=100``, ``split_seed``, ...); test rows and features are kept."""
    where = f"{federation.name}?{urlencode(sorted(options.items()))}"
    unknown = [key for key in options if key not in RESPLIT_OPTIONS]
    if unknown:
        raise FedrayError(f"dataset {where!r}: unknown option(s) {', '.join(unknown)}; a re-split takes {', '.join(RESPLIT_OPTIONS)}")
    typed = {}
    for key, value in options.items():
        kind = OPTION_TYPES[key]
        if isinstance(value, bool) or not isinstance(value, {int: numbers.Integral, float: numbers.Real, str: str}[kind]):
            raise FedrayError(f"dataset {where!r}: option {key} must be {TYPE_NAMES[kind]}, got {value!r}")
        typed[key] = kind(value)
        check_numeric_option(f"dataset {where!r}: option {key}", key, typed[key])
    _check_split(where, typed)
    return _resplit(where, federation, typed)


def _dataset_function(spec: str, target: str) -> Callable:
    """The function of a dataset plugin spec; ``module:function`` that does not load reads as an unknown dataset kind."""
    try:
        return load_function(target)
    except FedrayError as error:
        if target.rpartition(":")[0].endswith(".py"):
            raise
        raise FedrayError(f"unknown dataset {spec!r} ({error}); use {KNOWN}") from None


def _plugin_options(spec: str, function: Callable, options: dict[str, object]) -> tuple[dict[str, object], dict[str, object]]:
    """The spec's options split into the function's (typed by its signature) and the re-split ones (typed as any
    spec's); a key both could take goes to the function."""
    try:
        declared: dict[str, Option] = function_options(function)
    except (TypeError, NameError) as error:
        raise FedrayError(f"dataset {spec!r}: {error}") from None
    unknown = [key for key in options if key not in declared and key not in RESPLIT_OPTIONS]
    if unknown:
        raise FedrayError(f"dataset {spec!r}: unknown option(s) {', '.join(unknown)}; {function.__name__} takes "
                          f"{', '.join(declared) or 'none'}, and a re-split {', '.join(RESPLIT_OPTIONS)}")
    arguments = {key: declared[key].coerce(value, f"dataset {spec!r}") for key, value in options.items() if key in declared}
    split = {key: _typed(spec, key, str(value)) for key, value in options.items() if key not in declared}
    return arguments, split


def _called(spec: str, function: Callable, arguments: dict[str, object]) -> Federation:
    """``function(**arguments)``, which must return a :class:`Federation` (its ``ValueError`` is a one-line error)."""
    try:
        federation = function(**arguments)
    except ValueError as error:
        raise FedrayError(f"dataset {spec!r}: {error}") from None
    if not isinstance(federation, Federation):
        raise FedrayError(f"dataset {spec!r}: {function.__name__} returned {type(federation).__name__}, not a "
                          f"fedray.Federation (build one with fedray.Federation.from_arrays or from_table)")
    return federation


def recorded_backbone_macs(spec: str) -> float | None:
    """F_φ of a ``features:`` dataset: the forward multiply-adds per sample its cache recorded (None: not recorded, or no cache)."""
    kind, target, _ = parse_spec(spec)
    return find_entry(target).manifest().get("backbone_macs") if kind == "features" else None


def _load_hsu(target: str, options: dict) -> Federation:
    test = options.get("test") or hsu_test_csv_beside(target)
    images, layout = options.get("images"), options.get("layout", "walk")
    federation = load_hsu_split(target, test)
    if images is None:
        return federation
    paths = resolve_paths(images, federation.table.column("image_id").combine_chunks(), layout)
    return replace(federation, table=federation.table.append_column("image_path", paths))


def canonical_spec(spec: str) -> str:
    """``spec`` with absolute paths and sorted options: the same dataset always gets the same text."""
    kind, target, options = parse_spec(spec)
    if kind == MEMORY:
        return spec
    if kind == PLUGIN:
        target = canonical(target)
    elif kind in PATH_KINDS:
        target = str(Path(target).resolve())
    for key in PATH_OPTIONS:
        if key in options and kind != PLUGIN:
            options[key] = str(Path(str(options[key])).resolve())
    query = urlencode(sorted(options.items()), safe="/")
    return (target if kind == PLUGIN else f"{kind}:{target}") + (f"?{query}" if query else "")


def _no_options(spec: str, options: dict) -> None:
    if options:
        raise FedrayError(f"dataset {spec!r}: option(s) {', '.join(options)} do not apply to this kind")


def _check_split(spec: str, options: dict) -> None:
    """The re-split options name a known split and give what it needs (its values are checked against the data later)."""
    kind = options.get("split")
    if kind is None:
        raise FedrayError(f"dataset {spec!r}: option(s) {', '.join(options)} need split=dirichlet|dirichlet_per_class|classes")
    if kind not in SPLITS:
        raise FedrayError(f"dataset {spec!r}: unknown split {kind!r}; use dirichlet, dirichlet_per_class or classes")
    if "clients" not in options:
        raise FedrayError(f"dataset {spec!r}: split={kind} needs clients=K")
    if kind in ("dirichlet", "dirichlet_per_class") and "alpha" not in options:
        raise FedrayError(f"dataset {spec!r}: split={kind} needs alpha=A")
    if "min_client_size" in options and kind != "dirichlet_per_class":
        raise FedrayError(f"dataset {spec!r}: min_client_size applies to split=dirichlet_per_class only "
                          f"(split=dirichlet gives every client ⌊N/K⌋ samples)")
    if kind == "classes" and "classes_per_client" not in options:
        raise FedrayError(f"dataset {spec!r}: split=classes needs classes_per_client=C")


def _resplit(spec: str, federation: Federation, options: dict) -> Federation:
    """``federation``'s training samples re-split among new clients (``options`` passed :func:`_check_split`)."""
    kind, clients, seed = options["split"], options["clients"], options.get("split_seed", 0)
    table = federation.table
    labels = table.filter(pc.equal(table.column("split"), TRAIN)).column("label").to_numpy()
    if kind == "dirichlet":
        assignment = hsu_dirichlet_split(labels, clients, options["alpha"], seed)
    elif kind == "dirichlet_per_class":
        assignment = dirichlet_split(labels, clients, options["alpha"], seed, options.get("min_client_size", 1))
    else:
        assignment = classes_per_client_split(labels, clients, options["classes_per_client"], seed)
    return splitters.resplit(federation, assignment, spec)
