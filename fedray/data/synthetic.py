"""Synthetic federations shaped like the real vision splits.

Client sizes are the real ones (``client_sizes/*.csv``). The four iNaturalist
stand-ins partition one common sample pool (same labels, same features), so a
method immune to heterogeneity gives the same result on all four; only the
assignment of samples to clients differs.

How a split assigns samples to clients: classes lie on a line, ordered by a
coarse taxonomy; every sample gets the key ``position(class) + tau * noise``;
samples sorted by key are cut into clients of the real sizes (in a seeded
order). A small ``tau`` gives clients few, related classes (strong label skew);
``tau`` per split is calibrated so that iNat-User-120K has M ~ 54,590 (client,
class) pairs, as the real split does.

Features: ``clamp(base + mu_class + noise, 0, 6)`` (non-negative like pooled
ReLU6 activations). Class means share a superclass component (the taxonomy);
the noise has a shared anisotropic covariance (per-dimension scales plus a
strong low-rank correlated part), so whitening methods beat nearest-class-mean
as they do on real features. Noise is drawn in fixed blocks of pool sample ids
from generators seeded by (seed, split, block), so any subset of samples is
generated identically in any process, one shard at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from importlib import resources
from urllib.parse import urlencode

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from fedray.core.lazy_modules import lazy_module
from fedray.core.federation import TEST, TRAIN, Federation, split_table
from fedray.core.errors import FedrayError

torch = lazy_module("torch", globals())

BLOCK = 4096
LOW_RANK = 16


@dataclass(frozen=True)
class Pool:
    """A sample pool shared by the splits built on it."""

    num_classes: int
    num_train: int
    num_test: int
    num_superclasses: int


@dataclass(frozen=True)
class SplitShape:
    sizes_file: str
    pool: str
    tau: float


POOLS = {
    "inat": Pool(num_classes=1203, num_train=120_293, num_test=35_637, num_superclasses=13),
    "landmarks": Pool(num_classes=2028, num_train=151_373, num_test=17_964, num_superclasses=40),
}

SPLITS = {
    "inat-user-120k": SplitShape("inaturalist_user_120k.csv", "inat", tau=0.0157),
    "inat-geo-100": SplitShape("inaturalist_geo_100.csv", "inat", tau=0.05),
    "inat-geo-1k": SplitShape("inaturalist_geo_1k.csv", "inat", tau=0.1),
    "inat-geo-3k": SplitShape("inaturalist_geo_3k.csv", "inat", tau=0.2),
    "landmarks-user-160k": SplitShape("landmarks_user_160k.csv", "landmarks", tau=0.02),
}


@dataclass(frozen=True)
class LabelledShape:
    """A centralized labelled dataset of the papers, as one client ("all") to re-split with ``?split=…``.

    ``smallest`` and ``largest`` bound a linear profile of per-class training
    counts summing to the real training-set size (equal when both are equal).
    """

    num_classes: int
    num_train: int
    num_test: int
    smallest: int
    largest: int
    num_superclasses: int = 10


LABELLED = {
    # exact: 500 training images in each of 100 classes
    "cifar100": LabelledShape(100, 50_000, 10_000, 500, 500),
    # real totals and C; per-class counts approximate: a linear profile between the real smallest and largest class
    "cub200": LabelledShape(200, 5_994, 5_794, 29, 30),
    "cars": LabelledShape(196, 8_144, 8_041, 24, 68),
    # 30,000 images, the usual 80/20 split; the real per-class counts (imbalanced) were not at hand
    "imagenet-r": LabelledShape(200, 24_000, 6_000, 40, 344),
}
"""Datasets the FedCOF and FedNCM papers split with Dirichlet(α) over 100 clients (features synthetic)."""


def labelled_counts(shape: LabelledShape) -> np.ndarray:
    """Per-class training counts: a linear profile from ``smallest`` to ``largest`` rescaled to ``num_train``."""
    return rescale_sizes(np.linspace(shape.smallest, shape.largest, shape.num_classes), shape.num_train)


def real_client_sizes(sizes_file: str) -> np.ndarray:
    """The training clients' sizes from a packaged real client-size table."""
    with resources.as_file(resources.files("fedray.data") / "client_sizes" / sizes_file) as path:
        table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(column_types={"client": "string"}))
    clients = table.column("client").to_pylist()
    sizes = table.column("num_images").to_numpy()
    return np.array([s for c, s in zip(clients, sizes) if c != "test"], dtype=np.int64)


def rescale_sizes(sizes: np.ndarray, total: int) -> np.ndarray:
    """Sizes proportional to ``sizes`` summing exactly to ``total``, each ≥ 1 (largest remainder)."""
    exact = sizes * (total / sizes.sum())
    out = np.maximum(np.floor(exact).astype(np.int64), 1)
    short = total - out.sum()
    order = np.argsort(-(exact - np.floor(exact)), kind="stable")
    if short > 0:
        out[order[:short]] += 1
    elif short < 0:
        for i in np.argsort(-out, kind="stable")[: -short]:
            out[i] -= 1
    return out


def long_tail_counts(total: int, num_classes: int, rng: np.random.Generator, exponent: float = 0.6) -> np.ndarray:
    """Per-class counts with Zipf-like popularity, in a seeded class order, summing to ``total``."""
    popularity = np.arange(1, num_classes + 1, dtype=np.float64) ** -exponent
    return rescale_sizes(rng.permutation(popularity), total)


@dataclass
class SyntheticFeatures:
    """The feature model of a pool, evaluated for any subset of its samples."""

    pool: Pool
    dim: int
    seed: int
    train_labels: np.ndarray
    test_labels: np.ndarray
    train_clients: np.ndarray | None = None
    feature_shift: float = 0.0

    def __getstate__(self) -> dict:
        """Only the parameters travel; the model is rebuilt, identically, where it is used."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _generator(self, *stream: int) -> torch.Generator:
        state = np.random.SeedSequence([self.seed, *stream]).generate_state(1, np.uint64)[0]
        return torch.Generator().manual_seed(int(state))

    @cached_property
    def _model(self) -> dict[str, torch.Tensor]:
        g = self._generator(0)
        d, C, G = self.dim, self.pool.num_classes, self.pool.num_superclasses
        superclass = torch.arange(C) * G // C
        centers = torch.randn(G, d, generator=g)
        means = 0.24 * centers[superclass] + 0.06 * torch.randn(C, d, generator=g)
        scales = torch.exp(torch.empty(d).uniform_(np.log(0.3), np.log(0.9), generator=g))
        low_rank = 0.06 * torch.randn(LOW_RANK, d, generator=g)
        base = torch.empty(d).uniform_(0.0, 2.4, generator=g)
        return {"means": means, "scales": scales, "low_rank": low_rank, "base": base}

    @cached_property
    def _client_shift(self) -> torch.Tensor:
        num_clients = int(self.train_clients.max()) + 1
        return self.feature_shift * torch.randn(num_clients, self.dim, generator=self._generator(2))

    def labels_of(self, split: str, sample_ids: np.ndarray) -> np.ndarray:
        """The labels of ``split``'s samples ``sample_ids``."""
        return (self.train_labels if split == TRAIN else self.test_labels)[sample_ids]

    def features(self, split: str, sample_ids: np.ndarray) -> torch.Tensor:
        stream = 1 if split == TRAIN else 3
        shift = self._client_shift if split == TRAIN and self.feature_shift > 0 else None
        model = self._model
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        out = torch.empty(len(sample_ids), self.dim)
        blocks = sample_ids // BLOCK
        order = np.argsort(blocks, kind="stable")
        bounds = np.searchsorted(blocks[order], np.unique(blocks), side="left").tolist() + [len(order)]
        for start, stop in zip(bounds[:-1], bounds[1:]):
            rows = order[start:stop]
            block = int(blocks[rows[0]])
            g = self._generator(stream, block)
            noise = torch.randn(BLOCK, self.dim, generator=g) * model["scales"]
            noise += torch.randn(BLOCK, LOW_RANK, generator=g) @ model["low_rank"]
            ids = torch.from_numpy(sample_ids[rows])
            labels = torch.from_numpy(self.labels_of(split, sample_ids[rows]).astype(np.int64))
            values = noise[ids - block * BLOCK] + model["base"] + model["means"][labels]
            if shift is not None:
                values += shift[torch.from_numpy(self.train_clients[sample_ids[rows]].astype(np.int64))]
            out[torch.from_numpy(rows)] = values.clamp_(0.0, 6.0)
        return out


def pool_labels(pool: Pool, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train labels grouped by class (long-tailed counts), and shuffled test labels in proportion."""
    rng = np.random.default_rng([seed, 11])
    train_counts = long_tail_counts(pool.num_train, pool.num_classes, rng)
    test_counts = rescale_sizes(train_counts, pool.num_test)
    train = np.repeat(np.arange(pool.num_classes, dtype=np.int32), train_counts)
    test = rng.permutation(np.repeat(np.arange(pool.num_classes, dtype=np.int32), test_counts))
    return train, test


def _assign_clients(labels: np.ndarray, sizes: np.ndarray, num_classes: int, tau: float, rng: np.random.Generator):
    """Order samples by noisy class position and cut them into clients of ``sizes``.

    Returns ``(order, client_of_position)``: ``order[i]`` is the sample at sorted
    position ``i`` and ``client_of_position[i]`` its client.
    """
    counts = np.bincount(labels, minlength=num_classes)
    centers = (np.cumsum(counts) - counts / 2) / len(labels)
    keys = centers[labels] + tau * rng.standard_normal(len(labels))
    order = np.argsort(keys, kind="stable")
    client_sizes = sizes[rng.permutation(len(sizes))]
    return order, np.repeat(np.arange(len(sizes), dtype=np.int64), client_sizes)


def check(
    split: str,
    dim: int = 1280,
    seed: int = 0,
    feature_shift: float = 0.0,
    scale: float = 1.0,
    classes: int | None = None,
) -> None:
    """What :func:`build` refuses, found without building anything."""
    if split in LABELLED:
        if (feature_shift, scale, classes) != (0.0, 1.0, None):
            raise FedrayError(f"synthetic:{split}: a labelled dataset takes dim and seed only (re-split it with ?split=…)")
    elif split not in SPLITS:
        raise FedrayError(f"unknown synthetic split {split!r}; known: {', '.join([*SPLITS, *LABELLED])}")
    if dim < 1:
        raise FedrayError(f"synthetic:{split}: dim must be ≥ 1, got {dim}")
    if not 0 < scale <= 1:
        raise FedrayError(f"synthetic:{split}: scale must be in (0, 1], got {scale}")
    if classes is not None and classes < 1:
        raise FedrayError(f"synthetic:{split}: classes must be ≥ 1, got {classes}")


def build(
    split: str,
    dim: int = 1280,
    seed: int = 0,
    feature_shift: float = 0.0,
    scale: float = 1.0,
    classes: int | None = None,
) -> Federation:
    """The synthetic stand-in of ``split`` (see :data:`SPLITS`).

    ``scale`` < 1 keeps that fraction of the clients (a seeded random subset,
    with their real sizes) of the reference split, which makes the pool, and of
    every split built on it, which are then rescaled to that pool; the test set
    shrinks in proportion. ``classes`` uses fewer classes. Both make small
    federations of the real shape, e.g. for tests.
    """
    check(split, dim, seed, feature_shift, scale, classes)
    if split in LABELLED:
        return _labelled(split, dim, seed)
    shape = SPLITS[split]
    reference = SPLITS[_reference(shape.pool)]
    reference_sizes = _kept(real_client_sizes(reference.sizes_file), scale, seed)
    pool = POOLS[shape.pool]
    if scale < 1 or classes is not None:
        num_train = int(reference_sizes.sum())
        num_classes = min(classes or pool.num_classes, num_train)
        pool = Pool(
            num_classes=num_classes,
            num_train=num_train,
            num_test=max(1, round(pool.num_test * num_train / pool.num_train)),
            num_superclasses=min(pool.num_superclasses, num_classes),
        )
    labels_by_class, test_labels = pool_labels(pool, seed)
    ref_order, ref_clients = _assign_clients(
        labels_by_class, reference_sizes, pool.num_classes, reference.tau, np.random.default_rng([seed, 12])
    )
    train_labels = labels_by_class[ref_order]

    if shape is reference:
        client_of_sample = ref_clients
    else:
        sizes = rescale_sizes(_kept(real_client_sizes(shape.sizes_file), scale, seed), pool.num_train)
        order, by_position = _assign_clients(
            train_labels, sizes, pool.num_classes, shape.tau, np.random.default_rng([seed, 13, len(sizes)])
        )
        client_of_sample = np.empty(pool.num_train, dtype=np.int64)
        client_of_sample[order] = by_position

    source = SyntheticFeatures(
        pool=pool,
        dim=dim,
        seed=seed,
        train_labels=train_labels,
        test_labels=test_labels,
        train_clients=client_of_sample if feature_shift > 0 else None,
        feature_shift=feature_shift,
    )
    n_train, n_test = len(train_labels), len(test_labels)
    table = split_table(
        client_id=pa.concat_arrays(
            [pa.array(client_of_sample).cast(pa.string()), pa.nulls(n_test, pa.string())]
        ),
        sample_id=np.concatenate([np.arange(n_train), np.arange(n_test)]),
        label=np.concatenate([train_labels, test_labels]),
        split=np.repeat(np.array([TRAIN, TEST]), [n_train, n_test]),
    )
    options = {"classes": classes, "dim": dim, "feature_shift": feature_shift, "scale": scale, "seed": seed}
    return Federation(name=f"synthetic:{split}", num_classes=pool.num_classes, table=table, source=source,
                      spec=_spec(split, options))


def _labelled(name: str, dim: int, seed: int) -> Federation:
    """The labelled dataset ``name`` held by one client, ``all`` (as ``imagefolder:`` loads a dataset)."""
    shape = LABELLED[name]
    counts = labelled_counts(shape)
    pool = Pool(shape.num_classes, shape.num_train, shape.num_test, shape.num_superclasses)
    train_labels = np.repeat(np.arange(shape.num_classes, dtype=np.int32), counts)
    test_labels = np.random.default_rng([seed, 15]).permutation(
        np.repeat(np.arange(shape.num_classes, dtype=np.int32), rescale_sizes(counts, shape.num_test)))
    source = SyntheticFeatures(pool=pool, dim=dim, seed=seed, train_labels=train_labels, test_labels=test_labels)
    n_train, n_test = len(train_labels), len(test_labels)
    table = split_table(
        client_id=["all"] * n_train + [None] * n_test,
        sample_id=np.concatenate([np.arange(n_train), np.arange(n_test)]),
        label=np.concatenate([train_labels, test_labels]),
        split=np.repeat(np.array([TRAIN, TEST]), [n_train, n_test]),
    )
    return Federation(name=f"synthetic:{name}", num_classes=shape.num_classes, table=table, source=source,
                      spec=_spec(name, {"dim": dim, "seed": seed}))


def _spec(split: str, options: dict[str, object]) -> str:
    """The dataset spec :func:`build` reads back as these options (the canonical form: sorted, defaults written out)."""
    return f"synthetic:{split}?" + urlencode([(key, value) for key, value in sorted(options.items()) if value is not None])


def _reference(pool: str) -> str:
    return "inat-user-120k" if pool == "inat" else "landmarks-user-160k"


def _kept(sizes: np.ndarray, scale: float, seed: int) -> np.ndarray:
    """A seeded random subset of round(scale · K) of the clients' sizes (all of them at scale 1)."""
    if scale == 1:
        return sizes
    keep = max(1, round(scale * len(sizes)))
    return sizes[np.sort(np.random.default_rng([seed, 14]).choice(len(sizes), keep, replace=False))]
