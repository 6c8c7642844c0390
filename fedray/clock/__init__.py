"""The clock: devices, availability, client selection and rounds in virtual seconds (issue 37), as pure numpy parts."""
