"""`python -m client.cli`, the same as the `trainyard` script."""

from client.cli import main

main()
