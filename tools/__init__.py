"""Scripts for the people who work on Reservoir (not part of the installed package)."""
