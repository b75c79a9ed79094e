"""`python -m tandem` runs the `tandem` command."""

from tandem.cli import main

main()
