"""Small image datasets in the real layouts, written by the tests (no real images can be downloaded here)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from PIL import Image


def random_image(rng: np.random.Generator, mode: str = "RGB") -> Image.Image:
    """A smooth random picture of random size (low-resolution noise, upsampled), so resizing matters."""
    width, height = int(rng.integers(40, 120)), int(rng.integers(40, 120))
    channels = 1 if mode == "L" else 3
    coarse = rng.integers(0, 256, size=(6, 6, channels), dtype=np.uint8)
    image = Image.fromarray(coarse.squeeze(-1) if channels == 1 else coarse, mode)
    return image.resize((width, height), Image.BILINEAR)


def write_image_folder(root: Path, classes: int, train_per_class: int, test_per_class: int, seed: int = 0,
                       mode: str = "RGB") -> Path:
    """ROOT/{train,test}/class_XX/img_N.{jpg,png}: every third image a PNG; ``mode`` "L" writes grayscale images."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", train_per_class), ("test", test_per_class)):
        for c in range(classes):
            folder = root / split / f"class_{c:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                suffix = "png" if i % 3 == 2 else "jpg"
                random_image(rng, mode).save(folder / f"img_{i}.{suffix}")
    return root


def write_inat_split(root: Path, users: int, images_per_user: int, classes: int, test_images: int, seed: int = 0) -> tuple[Path, Path]:
    """iNat 2017 layout ``train_val_images/<super>/<species>/<id>.jpg`` plus Hsu et al. CSVs.

    Returns (train_csv, image_root). Classes are species numbered 0..classes-1,
    spread over two super-categories.
    """
    rng = np.random.default_rng(seed)
    images = root / "train_val_images"
    train_rows, test_rows = [], []
    for n in range(users * images_per_user + test_images):
        label = int(rng.integers(classes))
        image_id = f"{n:04x}{rng.integers(1 << 30):08x}"
        folder = images / f"Super{label % 2}" / f"Species_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        random_image(rng).save(folder / f"{image_id}.jpg")
        if n < users * images_per_user:
            train_rows.append((f"user{n // images_per_user}", image_id, label))
        else:
            test_rows.append((image_id, label))
    train_csv = root / "federated_train_user.csv"
    with open(train_csv, "w", newline="") as handle:
        csv.writer(handle).writerows([("user_id", "image_id", "class"), *train_rows])
    with open(root / "test.csv", "w", newline="") as handle:
        csv.writer(handle).writerows([("image_id", "class"), *test_rows])
    return train_csv, images


def write_squeezenet_weights(path: Path, seed: int = 11) -> Path:
    """A SqueezeNet 1.1 state dict of seeded random weights (NOT pre-trained: no weights are downloaded in tests)."""
    import torch
    import torchvision

    torch.manual_seed(seed)
    torch.save(torchvision.models.squeezenet1_1().state_dict(), path)
    return path
