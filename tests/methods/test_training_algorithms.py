"""The built-in training algorithms' registry: FedAvg's variants are FedAvg with another server optimizer."""

from fedray.engine.config import resolve
from fedray.methods.training_algorithms import (BUILT_IN, Alias, FedAvg, FedProx, Scaffold, algorithm_class,
                                                own_server_optimizer, paper_family)


def test_fedavgs_variants_are_registry_entries_of_fedavg_with_their_server_optimizer():
    for name in ("fedavgm", "fedadam", "fedadagrad", "fedyogi"):
        assert isinstance(BUILT_IN[name], Alias)
        assert algorithm_class(name) is FedAvg
        assert own_server_optimizer(name) == name
        config = resolve({}, {"method": name})
        assert (config.method, config.server_optimizer) == (name, name)
    assert [name for name, entry in BUILT_IN.items() if isinstance(entry, type)] == ["fedavg", "fedprox", "scaffold"]
    assert {name: own_server_optimizer(name) for name in ("fedavg", "fedprox", "scaffold")} == dict.fromkeys(
        ("fedavg", "fedprox", "scaffold"), "fedavg")


def test_the_papers_count_fedavgs_variants_as_fedavg():
    assert [paper_family(algorithm) for algorithm in (FedAvg(), FedProx(), Scaffold())] == ["fedavg", "fedavg",
                                                                                             "scaffold"]
