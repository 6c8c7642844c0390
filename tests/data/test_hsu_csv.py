from pathlib import Path

import numpy as np
import pytest

from fedray.core.federation import TEST, TRAIN
from fedray.data.hsu_csv import hsu_test_csv_beside, load_hsu_split
from fedray.core.errors import FedrayError

TRAIN_CSV = """user_id,image_id,class
u2,img1,7
u1,img2,3
u2,img3,3
u3,img4,12
u1,img5,7
u2,img6,12
"""

TEST_CSV = """image_id,class
t1,3
t2,12
t3,7
t4,3
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


@pytest.fixture
def split_files(tmp_path: Path) -> tuple[Path, Path]:
    return write(tmp_path, "federated_train_small.csv", TRAIN_CSV), write(tmp_path, "test.csv", TEST_CSV)


def test_clients_labels_and_columns(split_files):
    train_csv, test_csv = split_files
    fed = load_hsu_split(train_csv, test_csv)

    assert fed.name == "hsu:federated_train_small"
    assert fed.source is None
    # classes 3 < 7 < 12 numerically (lexicographic order would put "12" first)
    assert fed.num_classes == 3
    assert fed.num_clients == 3
    assert fed.client_ids == ["u2", "u1", "u3"]
    assert fed.client_sizes.tolist() == [3, 2, 1]
    assert fed.client_num_classes.tolist() == [3, 2, 1]

    table = fed.table
    assert table.column("sample_id").to_pylist() == list(range(10))
    assert table.column("split").to_pylist() == [TRAIN] * 6 + [TEST] * 4
    assert table.column("client_id").to_pylist() == ["u2", "u1", "u2", "u3", "u1", "u2"] + [None] * 4
    assert table.column("label").to_pylist() == [1, 0, 0, 2, 1, 2] + [0, 2, 1, 0]
    assert table.column("image_id").to_pylist() == [f"img{i}" for i in range(1, 7)] + ["t1", "t2", "t3", "t4"]
    assert table.column("class_name").to_pylist() == ["7", "3", "3", "12", "7", "12", "3", "12", "7", "3"]

    sample_ids, labels = fed.test_arrays()
    assert sample_ids.tolist() == [6, 7, 8, 9]
    assert labels.tolist() == [0, 2, 1, 0]
    sample_ids, labels, offsets = fed.train_arrays(0, 3)
    assert sample_ids.tolist() == [0, 2, 5, 1, 4, 3]
    assert offsets.tolist() == [0, 3, 5, 6]


def test_non_numeric_classes_sort_lexicographically_over_train_and_test(tmp_path):
    train_csv = write(tmp_path, "federated_train.csv", "user_id,image_id,class\na,1,dog\nb,2,10\nb,3,9\n")
    test_csv = write(tmp_path, "test.csv", "image_id,class\nx,ant\n")
    fed = load_hsu_split(train_csv, test_csv, name="pets")

    assert fed.name == "pets"
    assert fed.num_classes == 4  # "10" < "9" < "ant" < "dog"
    assert fed.table.column("label").to_pylist() == [3, 0, 1, 2]


def test_test_only_class_gets_a_label(tmp_path):
    train_csv = write(tmp_path, "federated_train.csv", "user_id,image_id,class\na,1,5\nb,2,1\n")
    test_csv = write(tmp_path, "test.csv", "image_id,class\nx,3\n")
    fed = load_hsu_split(train_csv, test_csv)

    assert fed.num_classes == 3
    assert fed.table.column("label").to_pylist() == [2, 0, 1]


def test_label_column_is_used_as_given(tmp_path):
    train_csv = write(
        tmp_path, "federated_train.csv", "user_id,image_id,class,label\nu1,a,zebra,4\nu2,b,ant,0\nu1,c,ant,0\n"
    )
    test_csv = write(tmp_path, "test.csv", "image_id,class,label\nt,zebra,4\ns,yak,6\n")
    fed = load_hsu_split(train_csv, test_csv)

    assert fed.num_classes == 7
    assert fed.table.column("label").to_pylist() == [4, 0, 0, 4, 6]
    assert fed.client_ids == ["u1", "u2"]
    assert fed.client_sizes.tolist() == [2, 1]
    assert fed.client_num_classes.tolist() == [2, 1]
    assert fed.table.column("class_name").to_pylist() == ["zebra", "ant", "ant", "zebra", "yak"]


def test_without_test_file(split_files):
    train_csv, _ = split_files
    fed = load_hsu_split(train_csv)

    assert fed.test.num_rows == 0
    assert fed.table.num_rows == 6
    assert fed.num_classes == 3
    assert fed.table.column("client_id").null_count == 0


def test_user_and_image_ids_stay_strings(tmp_path):
    train_csv = write(tmp_path, "federated_train.csv", "user_id,image_id,class\n007,0012,1\n7,12,1\n")
    fed = load_hsu_split(train_csv)

    assert fed.client_ids == ["007", "7"]
    assert fed.table.column("image_id").to_pylist() == ["0012", "12"]


def test_test_csv_beside(split_files, tmp_path):
    train_csv, test_csv = split_files
    assert hsu_test_csv_beside(train_csv) == test_csv
    alone = tmp_path / "alone"
    alone.mkdir()
    assert hsu_test_csv_beside(alone / "federated_train.csv") is None


GOOD_TEST = "image_id,class\nt1,1\n"


@pytest.mark.parametrize(
    ("train_text", "test_text", "in_file", "match"),
    [
        (None, GOOD_TEST, "federated_train.csv", "no such file"),
        ("user_id,image_id,class\nu,a,1\n", None, "test.csv", "no such file"),
        ("", GOOD_TEST, "federated_train.csv", "empty file"),
        ("user_id,image_id,class\n", GOOD_TEST, "federated_train.csv", "no train rows"),
        ("user_id,class\nu,1\n", GOOD_TEST, "federated_train.csv", "missing column.*image_id"),
        ("image_id,class\na,1\n", GOOD_TEST, "federated_train.csv", "missing column.*user_id"),
        ("user_id,image_id,class\nu,a,1\n", "image_id\nt1\n", "test.csv", "missing column.*class"),
        ("user_id,image_id,class\nu,a,1\n,b,1\n", GOOD_TEST, "federated_train.csv", "data row 2: empty user_id"),
        ("user_id,image_id,class\nu,a,1\nu, ,1\n", GOOD_TEST, "federated_train.csv", "data row 2: empty image_id"),
        ("user_id,image_id,class\nu,a,1\n", "image_id,class\nt1,1\n,2\n", "test.csv", "data row 2: empty image_id"),
        (
            "user_id,image_id,class\nu,a,1\nv,b,1\nw,a,2\n",
            GOOD_TEST,
            "federated_train.csv",
            "data row 3: duplicate image_id 'a' \\(first at data row 1\\)",
        ),
        (
            "user_id,image_id,class,label\nu,a,1,0\nv,b,1,one\n",
            "image_id,class,label\nt1,1,0\n",
            "federated_train.csv",
            "data row 2: label 'one' is not an integer",
        ),
        (
            "user_id,image_id,class,label\nu,a,1,0\nv,b,1,2.0\n",
            "image_id,class,label\nt1,1,0\n",
            "federated_train.csv",
            "data row 2: label '2.0' is not an integer",
        ),
        (
            "user_id,image_id,class,label\nu,a,1,0\n",
            "image_id,class,label\nt1,1,0\nt2,1,-3\n",
            "test.csv",
            "data row 2: negative label '-3'",
        ),
        (
            "user_id,image_id,class,label\nu,a,1,0\n",
            "image_id,class\nt1,1\n",
            "test.csv",
            "no label column",
        ),
        ("user_id,image_id,class\nu,a,1\nv,b\n", GOOD_TEST, "federated_train.csv", "cannot read as CSV"),
    ],
)
def test_bad_input_raises_fedray_error(tmp_path, train_text, test_text, in_file, match):
    train_csv, test_csv = tmp_path / "federated_train.csv", tmp_path / "test.csv"
    if train_text is not None:
        train_csv.write_text(train_text)
    if test_text is not None:
        test_csv.write_text(test_text)
    with pytest.raises(FedrayError, match=match) as caught:
        load_hsu_split(train_csv, test_csv)
    message = str(caught.value)
    assert in_file in message
    assert "\n" not in message


def test_a_folder_is_not_a_file(tmp_path):
    with pytest.raises(FedrayError, match="no such file"):
        load_hsu_split(tmp_path)


def test_many_rows_load_fast_enough(tmp_path):
    n = 20_000
    rng = np.random.default_rng(0)
    users = rng.integers(0, 500, n)
    classes = rng.integers(0, 100, n)
    lines = "".join(f"{u},img{i},{c}\n" for i, (u, c) in enumerate(zip(users, classes)))
    fed = load_hsu_split(write(tmp_path, "federated_train.csv", "user_id,image_id,class\n" + lines))

    assert fed.table.num_rows == n
    assert fed.num_classes == len(np.unique(classes))
    assert fed.num_clients == len(np.unique(users))
    assert np.array_equal(fed.table.column("label").to_numpy(), np.unique(classes, return_inverse=True)[1])
