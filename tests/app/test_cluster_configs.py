"""Cluster configurations: launcher YAMLs against the schema Ray publishes, KubeRay manifests by structure."""

import json
from importlib import import_module
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from fedray.app.sweeps.spec import load_sweep

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"
JOBS = Path(__file__).resolve().parents[2] / "jobs"
RAY_SCHEMA = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


@pytest.mark.parametrize("name", ["aws-gpu-autoscaling.yaml", "local-fake-autoscaling.yaml"])
def test_launcher_configs_follow_rays_schema(name):
    config = yaml.safe_load((CLUSTER / name).read_text())
    jsonschema.validate(config, RAY_SCHEMA)
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    assert workers and all(t.get("min_workers", 0) == 0 for t in workers), "worker groups scale from zero"
    assert sum(t["max_workers"] for t in workers) >= 1


def test_the_aws_config_has_an_autoscaling_gpu_group():
    config = yaml.safe_load((CLUSTER / "aws-gpu-autoscaling.yaml").read_text())
    head = config["available_node_types"][config["head_node_type"]]
    gpu = [t for t in config["available_node_types"].values() if t["resources"].get("GPU")]
    assert "GPU" not in head["resources"] and gpu and all(t["min_workers"] == 0 for t in gpu)
    assert any("--autoscaling-config" in command for command in config["head_start_ray_commands"])


def _containers(template: dict) -> list[dict]:
    return template["template"]["spec"]["containers"]


def test_the_kuberay_cluster_autoscales_a_gpu_group_from_zero():
    manifest = yaml.safe_load((CLUSTER / "kuberay-raycluster.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayCluster")
    spec = manifest["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["rayVersion"].split(".")[0] == ray.__version__.split(".")[0]
    (gpu,) = spec["workerGroupSpecs"]
    assert gpu["minReplicas"] == 0 < gpu["maxReplicas"] and gpu["rayStartParams"]["num-gpus"] == "1"
    assert _containers(gpu)[0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert _containers(spec["headGroupSpec"])[0]["name"] == "ray-head"


def test_the_rayjob_runs_a_shipped_sweep_on_an_autoscaling_cluster():
    manifest = yaml.safe_load((CLUSTER / "kuberay-rayjob-sweep.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayJob")
    entry = manifest["spec"]["entrypoint"].split()
    assert entry[:2] == ["python", "-m"]
    module = import_module(entry[2])
    assert entry[2].startswith("jobs.sweep_") and callable(module.main)
    load_sweep(JOBS / "sweeps" / f"{entry[2].removeprefix('jobs.sweep_')}.yaml")
    cluster = manifest["spec"]["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert all(group["minReplicas"] == 0 for group in cluster["workerGroupSpecs"])
