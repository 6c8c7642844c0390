"""``fedray methods``' listing (fedray/app/catalogue.py): each description whole, as a terminal shows it."""

import re

from fedray.app.catalogue import catalogue

ENTRY = re.compile(r"^  (\S+) +(\S.*)$")
"""A built-in's line: two spaces, its name, its description (option lines are indented further)."""


def test_each_description_is_its_docstrings_first_paragraph_whole_and_without_markup():
    text = catalogue()
    entries = dict(match.groups() for line in text.splitlines() if (match := ENTRY.match(line)))
    assert entries["fedcof-oracle"] == (
        "FedCOF with clients sharing their class covariances (the paper's upper bound), or, with 'covariance', only "
        "their diagonals or their spherical part σ²I, σ² = trace/d (FedCOF App. L, Fig. 9 right).")
    assert entries["dp-fedavg"] == (
        "User-level (ε, δ)-DP for training: each client's upload clipped jointly to S, weight 1, Gaussian noise σS on "
        "the sum, the fixed denominator κ; ε accounted for the run's sampling.")
    assert [name for name, description in entries.items() if not description.endswith((".", ")"))] == []
    assert "`" not in text
