"""`python -m reservoir` is the `reservoir` command (for installs without console scripts)."""

from reservoir.cli import main

main()
