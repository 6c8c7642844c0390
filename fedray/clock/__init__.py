"""The clock's components: devices, availability, selectors and round schedulers in virtual time (issue 37)."""
