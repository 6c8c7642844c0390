"""Image datasets: the input transform, bad-image policies, the image index and the folder / Hsu loaders."""

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms

from fedray.data.registry import canonical_spec, load_federation
from fedray.core.errors import FedrayError
from fedray.data.images.decode import GRAYSCALE, MISSING, UNREADABLE, ImageTransform, grayscale_images, load_image
from fedray.data.images.index import resolve_paths, walked_index
from tests.images import random_image, write_image_folder, write_inat_split


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDRAY_CACHE_DIR", str(tmp_path / "fedray-cache"))


def classic_eval_transform(size: int, resize: int) -> transforms.Compose:
    """torchvision's ImageNet evaluation recipe, written out independently of fedray."""
    return transforms.Compose([
        transforms.Resize(resize), transforms.CenterCrop(size), transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])


@pytest.mark.parametrize("size", [224, 299, 64])
def test_the_transform_is_the_imagenet_evaluation_recipe(tmp_path, size):
    path = tmp_path / "a.jpg"
    random_image(np.random.default_rng(size)).save(path)
    transform = ImageTransform(size=size)
    ours = load_image(str(path), transform, transform.pipeline())
    expected = classic_eval_transform(size, int(size * 256 / 224 + 0.5))(Image.open(path).convert("RGB"))
    assert ours.shape == (3, size, size)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_bad_images_are_named_not_raised(tmp_path):
    rng = np.random.default_rng(0)
    gray, broken = tmp_path / "gray.png", tmp_path / "broken.jpg"
    random_image(rng, "L").save(gray)
    broken.write_bytes(b"\xff\xd8 not really a jpeg")
    convert, skip = ImageTransform(size=32), ImageTransform(size=32, grayscale="skip")
    converted = load_image(str(gray), convert, convert.pipeline())
    assert converted.shape == (3, 32, 32)
    pixels = converted * torch.tensor(convert.std)[:, None, None] + torch.tensor(convert.mean)[:, None, None]
    torch.testing.assert_close(pixels[0], pixels[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(pixels[0], pixels[2], rtol=0, atol=1e-6)
    assert load_image(str(gray), skip, skip.pipeline()) == GRAYSCALE
    assert load_image(str(broken), convert, convert.pipeline()) == UNREADABLE
    assert load_image(str(tmp_path / "gone.jpg"), convert, convert.pipeline()) == MISSING
    assert load_image(None, convert, convert.pipeline()) == MISSING


def test_a_grayscale_dataset_is_decoded_with_one_channel(tmp_path):
    """channels=1: PIL's luminance, the ImageNet recipe's crop, normalized by the channels' mean mean and std."""
    rng = np.random.default_rng(3)
    gray, color = tmp_path / "gray.png", tmp_path / "color.jpg"
    random_image(rng, "L").save(gray)
    random_image(rng).save(color)
    transform = ImageTransform(size=28, channels=1)
    resize = int(28 * 256 / 224 + 0.5)
    for path in (gray, color):
        expected = transforms.Compose([
            transforms.Resize(resize), transforms.CenterCrop(28), transforms.ToTensor(),
            transforms.Normalize([(0.485 + 0.456 + 0.406) / 3], [(0.229 + 0.224 + 0.225) / 3]),
        ])(Image.open(path).convert("L"))
        ours = load_image(str(path), transform, transform.pipeline())
        assert ours.shape == (1, 28, 28)
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    assert "channels" not in ImageTransform().key(), "RGB feature caches keep their keys"
    assert ImageTransform(channels=1).key()["channels"] == 1
    with pytest.raises(FedrayError, match="1 or 3 channels"):
        ImageTransform(channels=2)


def test_grayscale_datasets_are_told_by_their_images_modes(tmp_path):
    rng = np.random.default_rng(4)
    paths = []
    for i, mode in enumerate(["L"] * 5 + ["RGB"]):
        paths.append(str(tmp_path / f"{i}.png"))
        random_image(rng, mode).save(paths[-1])
    assert grayscale_images(paths[:5]) and grayscale_images(paths[:5] + [None])
    assert not grayscale_images(paths), "one color image makes a dataset RGB"
    assert grayscale_images(paths, probes=2) is False, "the first and the last are probed"
    assert grayscale_images(paths[:5] + paths[:5] + [paths[5]], probes=3) is False
    assert not grayscale_images([]) and not grayscale_images([None])


def test_transform_options_are_checked():
    with pytest.raises(FedrayError, match="--resize"):
        ImageTransform(size=224, resize=200)
    with pytest.raises(FedrayError, match="--grayscale"):
        ImageTransform(grayscale="drop")


def test_the_walked_index_finds_inat_paths_and_is_cached(tmp_path):
    train_csv, images = write_inat_split(tmp_path / "inat", users=3, images_per_user=2, classes=4, test_images=2)
    federation = load_federation(f"hsu:{train_csv}?images={images}")
    paths = federation.table.column("image_path").to_pylist()
    for image_id, path in zip(federation.table.column("image_id").to_pylist(), paths):
        assert path.startswith(str(images.resolve()) + "/Super") and path.endswith(f"/{image_id}.jpg")
    first = walked_index(images.resolve())
    new = images / "Super0" / "Species_0" / "ffffffff.jpg"
    random_image(np.random.default_rng(1)).save(new)
    assert walked_index(images.resolve()).equals(first), "the second lookup reads the cached index, not the tree"


def test_an_image_id_without_a_file_gets_no_path(tmp_path):
    train_csv, images = write_inat_split(tmp_path / "inat", users=2, images_per_user=2, classes=2, test_images=1)
    victim = sorted(images.rglob("*.jpg"))[0]
    victim.unlink()
    federation = load_federation(f"hsu:{train_csv}?images={images}")
    missing = federation.table.filter(federation.table.column("image_path").is_null())
    assert missing.column("image_id").to_pylist() == [victim.stem]


def test_duplicate_image_ids_are_an_error(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        random_image(np.random.default_rng(0)).save(tmp_path / folder / "same.jpg")
    with pytest.raises(FedrayError, match="'same' names several files"):
        walked_index(tmp_path)


def test_gldv2_paths_are_computed(tmp_path):
    import pyarrow as pa

    paths = resolve_paths(tmp_path, pa.array(["abcdef", "x1y2z3"]), "gldv2").to_pylist()
    assert paths == [f"{tmp_path}/a/b/c/abcdef.jpg", f"{tmp_path}/x/1/y/x1y2z3.jpg"]
    with pytest.raises(FedrayError, match="unknown image layout"):
        resolve_paths(tmp_path, pa.array(["a"]), "flat")


def test_an_image_folder_is_one_client_until_split(tmp_path):
    root = write_image_folder(tmp_path / "folder", classes=3, train_per_class=6, test_per_class=2)
    federation = load_federation(f"imagefolder:{root}")
    assert federation.num_classes == 3 and federation.num_clients == 1 and federation.test.num_rows == 6
    assert federation.client_ids == ["all"]
    labels = federation.train.column("label").to_numpy()
    names = federation.train.column("class_name").to_pylist()
    assert [f"class_{label:02d}" for label in labels] == names
    assert all(f"/train/{name}/" in path for name, path in zip(names, federation.train.column("image_path").to_pylist()))
    split = load_federation(f"imagefolder:{root}?split=dirichlet&alpha=0.5&clients=3")  # 18 = 3 × 6: nothing dropped
    assert split.num_clients == 3 and split.client_sizes.tolist() == [6, 6, 6]
    assert sorted(split.train.column("image_path").to_pylist()) == sorted(federation.train.column("image_path").to_pylist())


def test_image_folder_errors(tmp_path):
    with pytest.raises(FedrayError, match="no train/ folder"):
        load_federation(f"imagefolder:{tmp_path}")
    (tmp_path / "train" / "cat").mkdir(parents=True)
    with pytest.raises(FedrayError, match="no images"):
        load_federation(f"imagefolder:{tmp_path}")


def test_canonical_specs_name_the_same_dataset_the_same_way(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = canonical_spec("hsu:split/train.csv?layout=walk&images=imgs")
    b = canonical_spec(f"hsu:{tmp_path}/split/../split/train.csv?images={tmp_path}/imgs&layout=walk")
    assert a == b == f"hsu:{tmp_path}/split/train.csv?images={tmp_path}/imgs&layout=walk"
    assert canonical_spec("synthetic:inat-geo-100?seed=2&dim=8") == "synthetic:inat-geo-100?dim=8&seed=2"
