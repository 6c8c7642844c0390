"""The clock: what clients' tasks cost in virtual time (devices, availability, selection, rounds), as pure,
vectorised numpy components of the methods layer."""
