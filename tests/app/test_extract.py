"""The extraction pool and feature cache, on generated images with seeded random weights (not pre-trained)."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch
import torchvision
from PIL import Image

from fedray.app.cli import main
from fedray.data import feature_cache as cache
from fedray.data.registry import load_federation
from fedray.core.errors import FedrayError
from fedray.app.extract.config import ExtractConfig
from fedray.app.extract.features import extract
from fedray.app.extract.pool import ExtractionPool
from fedray.data.images.backbones import get_backbone, load_weights
from fedray.data.images.decode import ImageTransform
from tests.images import random_image, write_image_folder, write_inat_split, write_squeezenet_weights
from tests.data.test_images import classic_eval_transform

SIZE = 64


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDRAY_CACHE_DIR", str(tmp_path / "fedray-cache"))


@pytest.fixture
def weights_file(tmp_path):
    return write_squeezenet_weights(tmp_path / "squeezenet.pt")


def direct_features(weights_file, paths: list[str]) -> np.ndarray:
    """``model(x)`` on the same images, with torchvision's own model and transforms, one image at a time."""
    model = torchvision.models.squeezenet1_1()
    model.load_state_dict(torch.load(weights_file, weights_only=True))
    model.eval()
    transform = classic_eval_transform(SIZE, round(SIZE * 256 / 224))
    with torch.inference_mode():
        return np.concatenate([
            torch.nn.functional.adaptive_avg_pool2d(model.features(transform(Image.open(p).convert("RGB"))[None]), 1).flatten(1).numpy()
            for p in paths
        ])


def config(dataset: str, out, weights_file, **options) -> ExtractConfig:
    settings = {"backbone": "squeezenet1_1", "weights": str(weights_file), "image_size": SIZE, "batch_size": 8, "quiet": True}
    return ExtractConfig(dataset=dataset, out=str(out), **{**settings, **options})


def cached_rows(entry: str) -> pa.Table:
    return cache.CacheEntry(Path(entry)).rows()


def cached_features(entry: str) -> np.ndarray:
    return cache.CacheEntry(Path(entry)).features()


def check_against_direct(federation_with_paths, entry: str, weights_file) -> None:
    rows = cached_rows(entry)
    assert sorted(rows.column("sample_id").to_pylist()) == sorted(federation_with_paths.table.column("sample_id").to_pylist())
    by_sample = dict(zip(federation_with_paths.table.column("sample_id").to_pylist(), federation_with_paths.table.column("image_path").to_pylist()))
    paths = [by_sample[s] for s in rows.column("sample_id").to_pylist()]
    np.testing.assert_allclose(cached_features(entry), direct_features(weights_file, paths), rtol=0, atol=1e-4)
    labels = dict(zip(federation_with_paths.table.column("sample_id").to_pylist(), federation_with_paths.table.column("label").to_pylist()))
    assert rows.column("label").to_pylist() == [labels[s] for s in rows.column("sample_id").to_pylist()]


def test_pool_features_match_the_model_on_an_inat_split(ray_session, tmp_path, weights_file):
    train_csv, images = write_inat_split(tmp_path / "inat", users=6, images_per_user=3, classes=4, test_images=6)
    spec = f"hsu:{train_csv}?images={images}"
    report = extract(config(spec, tmp_path / "cache", weights_file))
    assert not report.cache_hit and report.parts_computed == 2 and report.images_computed == 24
    gpus = int(ray.cluster_resources().get("GPU", 0))   # the default pool: a replica per GPU, else per CPU (2 here)
    expected = (gpus, "cuda") if gpus else (2, "cpu")
    assert (len(report.workers), *{w["device"] for w in report.workers}) == expected
    check_against_direct(load_federation(spec), report.entry, weights_file)   # on a GPU too: IEEE float32, not TF32
    federation = load_federation(f"features:{tmp_path / 'cache'}")
    source = load_federation(spec)
    assert federation.num_clients == source.num_clients and federation.num_classes == source.num_classes
    assert federation.client_ids == source.client_ids and federation.dim == 512


@pytest.fixture
def folder(tmp_path):
    return write_image_folder(tmp_path / "folder", classes=3, train_per_class=8, test_per_class=2)


def test_pool_features_match_the_model_on_an_image_folder(ray_session, tmp_path, folder, weights_file):
    spec = f"imagefolder:{folder}?split=classes&classes_per_client=2&clients=4"
    report = extract(config(spec, tmp_path / "cache", weights_file, pool_size=1))
    assert report.images_computed == 30 and len(report.workers) == 1
    check_against_direct(load_federation(spec), report.entry, weights_file)
    assert load_federation(f"features:{report.entry}").num_clients == 4


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_a_second_run_does_no_model_work(ray_session, tmp_path, folder, weights_file, monkeypatch):
    first = extract(config(f"imagefolder:{folder}", tmp_path / "cache", weights_file))
    before = cached_features(first.entry)

    def no_pool(*args, **kwargs):
        raise AssertionError("a cache hit must not start replicas")

    monkeypatch.setattr(ExtractionPool, "start", no_pool)
    second = extract(config(f"imagefolder:{folder}", tmp_path / "cache", weights_file))
    assert second.cache_hit and second.entry == first.entry and second.parts_computed == 0
    np.testing.assert_array_equal(cached_features(second.entry), before)
    other = config(f"imagefolder:{folder}", tmp_path / "cache", weights_file, image_size=48)
    with pytest.raises(AssertionError, match="must not start"):
        extract(other)


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_an_interrupted_run_resumes_from_its_finished_parts(ray_session, tmp_path, folder, weights_file, monkeypatch):
    monkeypatch.setattr(cache, "PART_ROWS", 5)
    full = extract(config(f"imagefolder:{folder}", tmp_path / "cache", weights_file))
    entry = cache.CacheEntry(Path(full.entry))
    assert full.parts_computed == 5 + 2
    expected = cached_features(full.entry)
    (entry.path / cache.MANIFEST).unlink()
    entry.part_path("train", 2).unlink()
    entry.part_path("test", 0).unlink()
    (entry.path / cache.PARTS / ".train-00003.parquet.abc.tmp").write_bytes(b"half a part")
    stale = [entry.path / ".manifest.json.ab12cd34.tmp", entry.path / cache.PARTS / ".train-00002.parquet.0f1e2d3c.tmp"]
    for path in stale:
        path.write_bytes(b"what an interrupted write left")
    with pytest.raises(FedrayError, match="unfinished feature extraction"):
        load_federation(f"features:{entry.path}")
    resumed = extract(config(f"imagefolder:{folder}", tmp_path / "cache", weights_file))
    assert (resumed.parts_computed, resumed.parts_reused, resumed.images_computed) == (2, 5, 5 + 5)
    np.testing.assert_array_equal(cached_features(resumed.entry), expected)
    assert not any(path.exists() for path in stale), "the resumed run removes its own stale temporaries"
    assert (entry.path / cache.PARTS / ".train-00003.parquet.abc.tmp").exists(), "not a name fedray writes: left alone"


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_bad_images_are_counted_and_skipped_or_stop_the_run(ray_session, tmp_path, folder, weights_file):
    random_image(np.random.default_rng(0), "L").save(folder / "train" / "class_00" / "gray.png")
    (folder / "train" / "class_01" / "broken.jpg").write_bytes(b"\xff\xd8 truncated")
    report = extract(config(f"imagefolder:{folder}", tmp_path / "skip", weights_file, grayscale="skip"))
    assert report.skipped == {"grayscale": 1, "unreadable": 1}
    assert json.loads((Path(report.entry) / cache.MANIFEST).read_text())["skipped"] == report.skipped
    federation = load_federation(f"features:{report.entry}")
    assert federation.train.num_rows == 24 and federation.test.num_rows == 6
    converted = extract(config(f"imagefolder:{folder}", tmp_path / "convert", weights_file))
    assert converted.skipped == {"unreadable": 1}
    with pytest.raises(FedrayError, match="broken.jpg: unreadable image"):
        extract(config(f"imagefolder:{folder}", tmp_path / "fail", weights_file, on_bad_image="fail"))
    assert not any((tmp_path / "fail").rglob(cache.MANIFEST))


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_a_missing_image_is_reported_or_stops_the_run(ray_session, tmp_path, weights_file):
    train_csv, images = write_inat_split(tmp_path / "inat", users=3, images_per_user=2, classes=2, test_images=2)
    victim = sorted(images.rglob("*.jpg"))[0]
    victim.unlink()
    spec = f"hsu:{train_csv}?images={images}"
    assert extract(config(spec, tmp_path / "cache", weights_file)).skipped == {"missing": 1}
    with pytest.raises(FedrayError, match=f"image '{victim.stem}' not found"):
        extract(config(spec, tmp_path / "fail", weights_file, on_bad_image="fail"))


def test_bad_extraction_requests_fail_before_any_work(tmp_path, folder, weights_file):
    train_csv, _ = write_inat_split(tmp_path / "inat", users=2, images_per_user=1, classes=2, test_images=1)
    cases = [
        (config(f"hsu:{train_csv}", tmp_path / "c", weights_file), "no images to extract from"),
        (config(f"imagefolder:{folder}", tmp_path / "c", weights_file, on_bad_image="ignore"), "--on-bad-image"),
        (config(f"imagefolder:{folder}", tmp_path / "c", weights_file, precision="fp8"), "--precision"),
        (config(f"imagefolder:{folder}", tmp_path / "c", weights_file, batch_size=0), "--batch-size"),
        (config(f"imagefolder:{folder}", tmp_path / "c", weights_file, cpus_per_worker=float("inf")), "--cpus-per-worker must be a finite number"),
        (config(f"imagefolder:{folder}", tmp_path / "c", weights_file, seed=-1), "--seed must be an integer from 0"),
        (ExtractConfig(f"imagefolder:{folder}", backbone="vit_b_16", weights="random", image_size=64, out=str(tmp_path / "c")), "224-pixel"),
        (ExtractConfig(f"imagefolder:{folder}", backbone="alexnet", out=str(tmp_path / "c")), "unknown backbone"),
    ]
    for request, message in cases:
        with pytest.raises(FedrayError, match=message):
            extract(request)
    assert not (tmp_path / "c").exists()


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_images_to_metrics_end_to_end(ray_session, tmp_path, weights_file, capsys):
    train_csv, images = write_inat_split(tmp_path / "inat", users=10, images_per_user=3, classes=3, test_images=9)
    spec = f"hsu:{train_csv}?images={images}"
    common = ["--backbone", "squeezenet1_1", "--weights", str(weights_file), "--image-size", str(SIZE), "--quiet"]
    assert main(["extract", "--dataset", spec, "--out", str(tmp_path / "cache"), *common]) == 0
    entry = capsys.readouterr().out.split("features:")[-1].strip()
    assert main(["run", "--method", "fed3r", "--dataset", f"features:{entry}", "--clients-per-round", "3",
                 "--eval-every", "2", "--out", str(tmp_path / "run"), "--quiet"]) == 0
    metrics = pq.read_table(tmp_path / "run" / "metrics.parquet")
    assert metrics.column("round").to_pylist() == [2, 4]
    assert metrics.column("clients_seen").to_pylist() == [6, 10]
    assert all(0 <= a <= 1 for a in metrics.column("accuracy").to_pylist())
    assert metrics.column("dataset").to_pylist() == [f"features:{entry}"] * 2


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_reduced_precision_is_its_own_cache_entry_and_close_to_fp32(ray_session, tmp_path, folder, weights_file):
    full = extract(config(f"imagefolder:{folder}", tmp_path / "cache", weights_file, pool_size=1))
    bf16 = extract(config(f"imagefolder:{folder}", tmp_path / "cache", weights_file, pool_size=1, precision="bf16"))
    assert bf16.entry != full.entry and not bf16.cache_hit
    reference = cached_features(full.entry)
    np.testing.assert_allclose(cached_features(bf16.entry), reference, rtol=0, atol=0.05 * np.abs(reference).max())


@pytest.mark.slow  # a restarted actor imports torch and builds its model again
def test_a_restarted_replica_fetches_the_weights_again_and_gives_the_same_features(ray_session, folder, weights_file):
    """The weights come with every call, so a restarted replica (its constructor took small things only) rebuilds
    the same model."""
    federation = load_federation(f"imagefolder:{folder}?split=classes&classes_per_client=2&clients=4")
    sample_ids, paths = federation.table.column("sample_id").to_numpy(), federation.table.column("image_path").to_pylist()
    backbone = get_backbone("squeezenet1_1")
    pool = ExtractionPool.start(backbone, load_weights(backbone, str(weights_file)).state_dict, ImageTransform(SIZE),
                                batch_size=8, pool_size=1)
    try:
        before = ray.get(pool.extract(0, sample_ids, paths))
        ray.kill(pool.actors[0], no_restart=False)
        after = ray.get(pool.extract(0, sample_ids, paths))
    finally:
        pool.shutdown()
    assert np.array_equal(after.sample_ids, before.sample_ids) and np.array_equal(after.features, before.features)
    assert len(before.sample_ids) == 30
